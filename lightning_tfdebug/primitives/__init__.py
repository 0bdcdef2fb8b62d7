"""The leaf layer: pure helpers every other layer may import (batch views, the model-call record, trackers, the
logged-key schema, tensor helpers). It imports nothing else of the package."""
