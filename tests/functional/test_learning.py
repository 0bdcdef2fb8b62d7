import math

from lightning_tfdebug.functional.learning import learned, progress, trained_before

LN_V = math.log(259)  # the byte corpus of tests/healthy_models.py
H = 2.93  # its labels' unigram entropy (measured 2.83 to 3.05 over the families' first batches)


def test_progress_runs_from_ln_v_to_the_unigram_entropy():
    assert progress(LN_V, LN_V, H) == 0.0
    assert math.isclose(progress(H, LN_V, H), 1.0)
    assert progress(1.0, LN_V, H) > 1.0  # a model that uses its context
    assert progress(1.05 * LN_V, LN_V, H) < 0  # PyTorch's default init: a little above ln(V)
    assert math.isnan(progress(math.nan, LN_V, H)) and math.isnan(progress(2.0, math.nan, H))
    # unknown unigram entropy: half of ln(V) is assumed; labels near uniform: any fall below ln(V) counts
    assert math.isclose(progress(LN_V / 2, LN_V), 1.0)
    assert progress(0.9 * LN_V, LN_V, 0.999 * LN_V) > 1.0


def test_untrained_models_of_every_init_against_fine_tunes():
    # first measured losses, measured (module docstring): untrained at lr 1e-8, then fine-tunes of `pretrain`
    for first in (5.543, 5.542, 5.557, 5.754, 5.878):
        assert trained_before(first, LN_V, H) is False
        assert trained_before(first, LN_V) is False
    for first in (2.646, 0.986, 2.855, 2.976, 2.624, 2.933, 3.735):  # TinyGPT, encoder LM, GPT-2, Llama, BERT, T5
        assert trained_before(first, LN_V, H) is True
        assert trained_before(first, LN_V) is True
    assert trained_before(2.0, math.nan, H) is None


def test_learned_before_or_in_this_run_beyond_the_frequencies():
    assert learned(2.6, 2.6, LN_V, H)  # a fine-tune
    assert learned(5.55, 2.0, LN_V, H)  # from scratch, now below the unigram entropy: it learned
    assert not learned(5.55, 5.50, LN_V, H)  # from scratch, still at ln(V)
    # a learning rate far too low still learns the frequencies first: that is not learning
    assert not learned(5.55, 2.95, LN_V, H)
    assert learned(math.nan, math.nan, LN_V, H) is None
