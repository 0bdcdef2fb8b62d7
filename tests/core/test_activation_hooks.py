import torch
import torch.nn.functional as F
from torch import nn

from lightning_tfdebug.core.activation_hooks import ActivationHooks


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 6)
        self.act = nn.ReLU()
        self.out = nn.Linear(6, 4)

    def forward(self, x):
        return self.out(F.gelu(self.act(self.fc(x))))  # one activation module, one function call


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = Mlp()
        self.head = nn.Tanh()

    def forward(self, x):
        return self.head(self.mlp(x))


def hooks_on(model):
    return sum(len(m._forward_hooks) for m in model.modules())


def test_hooks_exist_only_between_attach_and_remove_and_count_each_layer():
    model = Net()
    hooks = ActivationHooks(model, layers=None, preactivations=None, functional=False, saturation_grad=0.01)
    assert [(layer.name, layer.kind) for layer in hooks.layers] == [("mlp.act", "relu"), ("head", "tanh")]
    model(torch.randn(3, 4))  # not measured: nothing attached, nothing counted
    assert hooks_on(model) == 0 and [layer.calls for layer in hooks.layers] == [0, 0]
    hooks.attach()
    assert hooks_on(model) == 2
    model(torch.randn(3, 4))
    hooks.remove()
    assert hooks_on(model) == 0
    assert [(layer.calls, layer.numel) for layer in hooks.layers] == [(1, 18), (1, 12)]
    hooks.reset()
    assert [layer.calls for layer in hooks.layers] == [0, 0]


def test_function_calls_are_found_at_discovery_and_fixed_afterwards():
    model = Net()
    hooks = ActivationHooks(model, layers=None, preactivations=None, functional=True, saturation_grad=0.01)
    hooks.attach()
    model(torch.randn(3, 4))
    hooks.remove()
    hooks.adopt_function_layers()  # one process: no collective
    assert [layer.name for layer in hooks.layers] == ["mlp.act", "head", "mlp.gelu()"]
    assert not hooks.discovering and hooks.layers[2].calls == 1
    hooks.attach()  # after discovery: the mode runs only inside the MLP
    model(torch.randn(5, 4))
    hooks.remove()
    assert [layer.calls for layer in hooks.layers] == [1, 1, 1] and hooks.layers[2].numel == 30
    assert torch._C._len_torch_function_stack() == 0 and hooks_on(model) == 0


def test_preactivations_apply_the_activation_to_the_named_module_output():
    model = Net()
    with torch.no_grad():
        model.mlp.fc.bias.fill_(-100.0)  # every pre-activation far negative: ReLU of it is all zeros
    hooks = ActivationHooks(
        model, layers=r"^head$", preactivations={r"mlp\.fc$": "relu"}, functional=False, saturation_grad=0.01
    )
    assert [(layer.name, layer.from_preactivation) for layer in hooks.layers] == [("mlp.fc", True), ("head", False)]
    hooks.attach()
    model(torch.randn(3, 4))
    hooks.remove()
    fc = hooks.layers[0]
    assert fc.zeros.item() == 18 and not fc.alive.any()
