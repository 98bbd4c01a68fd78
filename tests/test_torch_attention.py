"""PyTorch's own attention (issue 46): ``nn.MultiheadAttention``, ``nn.TransformerEncoderLayer`` and
``nn.TransformerEncoder`` recorded through ``ModuleCapture`` and checked by the capture invariant;
h is the input of the module's functional out-projection (kpca_repro.capture.torch_attention)."""

from __future__ import annotations

import re
import warnings

import h5py
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kpca_repro.activations import CaptureMismatchError, main, validate
from kpca_repro.capture.module_capture import HooksDidNotFireError, ModuleCapture, capture_batches, record_activations
from kpca_repro.capture.vision import UnsupportedArchitectureError

from conftest import REPO

ORIGINAL_LINEAR = F.linear


@pytest.fixture(autouse=True)
def _pytorch_state_is_restored():
    """Every capture gives back torch.nn.functional.linear and the MHA fast path as it found them."""
    yield
    assert F.linear is ORIGINAL_LINEAR and torch.backends.mha.get_fastpath_enabled()


def _encoder(batch_first=True, norm_first=False, seed=0):
    torch.manual_seed(seed)
    with warnings.catch_warnings():  # "enable_nested_tensor is True, but self.use_nested_tensor is False": the model as a user builds it
        warnings.simplefilter("ignore", UserWarning)
        layer = nn.TransformerEncoderLayer(64, 4, 128, batch_first=batch_first, norm_first=norm_first)
        return nn.TransformerEncoder(layer, 2).eval()


def _padding(b=3, n=9):
    """key_padding_mask (True = padded) of unequal lengths: 9, 6, 3 real tokens."""
    pad = torch.zeros(b, n, dtype=torch.bool)
    pad[1, 6:] = True
    pad[2, 3:] = True
    return pad


def _src(batch_first, b=3, n=9, seed=1):
    x = torch.randn(b, n, 64, generator=torch.Generator().manual_seed(seed))
    return x if batch_first else x.transpose(0, 1).contiguous()


class Attend(nn.Module):
    """nn.MultiheadAttention alone, called as a user calls it (self-attention, optional padding)."""

    def __init__(self, batch_first=True, need_weights=True, average_attn_weights=True):
        super().__init__()
        torch.manual_seed(2)
        self.attn = nn.MultiheadAttention(32, 4, batch_first=batch_first)
        self.need_weights, self.average = need_weights, average_attn_weights
        self.out = None

    def forward(self, x, key_padding_mask=None):
        self.out, _ = self.attn(x, x, x, key_padding_mask=key_padding_mask, need_weights=self.need_weights, average_attn_weights=self.average)
        return self.out


def _measured(summary) -> float:
    return float(summary.capture_max_rel_error)


# --------------------------------------------------------------------------------------
# nn.TransformerEncoder and nn.TransformerEncoderLayer
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("norm_first", [False, True])
def test_transformer_encoder_is_recorded_and_validates(tmp_path, batch_first, norm_first):
    """Two layers, d_model 64, 4 heads: a padded batch and an unpadded one, through record_activations
    and the validator (measured: 9.5e-8 to 1.5e-7 of max |v|)."""
    enc = _encoder(batch_first, norm_first)
    capture = ModuleCapture.for_torch_attention(enc)
    assert capture.names == ["layers.0.self_attn", "layers.1.self_attn"]
    batches = [{"src": _src(batch_first), "src_key_padding_mask": _padding()}, {"src": _src(batch_first, b=2, seed=4)}]
    path = tmp_path / "enc.h5"
    summary = record_activations(enc, capture, batches, path, model_id="torch_encoder")
    assert summary.kind == "text" and (summary.n_inputs, summary.n_layers, summary.n_heads, summary.n_tokens, summary.head_dim) == (5, 2, 4, 9, 16)
    assert _measured(summary) <= 1e-6, _measured(summary)
    assert validate(path).capture_max_rel_error == summary.capture_max_rel_error
    assert main(["validate", str(path)]) == 0
    with h5py.File(path) as f:
        assert f["attention_mask"][:].sum(axis=1).tolist() == [9, 6, 3, 9, 9]  # the key padding, then an unpadded batch
        assert f.attrs["capture_adapter"] == "ModuleCapture"


def test_the_users_call_with_self_attn_modules_and_a_qkv_function(tmp_path):
    """The call of issue 46 (self_attn modules and a hand-written q/k/v function) ended in
    HooksDidNotFireError [(0, 'h'), (1, 'h')]; h is now taken at the out-projection call."""
    enc = _encoder()

    def qkv(m, args, kwargs):
        x = args[0]
        b, n, _ = x.shape
        q, k, v = F.linear(x, m.in_proj_weight, m.in_proj_bias).chunk(3, dim=-1)
        return tuple(t.reshape(b, n, m.num_heads, -1).transpose(1, 2) for t in (q, k, v))

    capture = ModuleCapture([layer.self_attn for layer in enc.layers], qkv)
    summary = record_activations(enc, capture, [_src(True)], tmp_path / "u.h5", model_id="user_encoder")
    assert summary.kind == "vision" and _measured(summary) <= 1e-6


def test_a_transformer_encoder_layer_alone(tmp_path):
    enc = _encoder()
    layer = enc.layers[0]
    summary = record_activations(layer, ModuleCapture.for_torch_attention(layer), [{"src": _src(True), "src_key_padding_mask": _padding()}], tmp_path / "l.h5", model_id="layer")
    assert summary.n_layers == 1 and _measured(summary) <= 1e-6


def test_the_captured_h_is_what_the_module_projected(tmp_path):
    """Independence of h from q, k, v: out_proj applied to the captured h gives back each
    module's own output (its forward hook), and the captured tensors match a direct recomputation."""
    enc = _encoder()
    outputs = []
    handles = [layer.self_attn.register_forward_hook(lambda _m, _a, out: outputs.append(out[0])) for layer in enc.layers]
    capture = ModuleCapture.for_torch_attention(enc)
    (_, layers), *_ = capture_batches(enc, capture, [{"src": _src(True), "src_key_padding_mask": _padding()}], model_id="enc")
    for h in handles:
        h.remove()
    for layer, (mod, out) in enumerate(zip(enc.layers, outputs)):
        h = torch.from_numpy(layers[layer]["h"])  # (B, H, N, d)
        concat = h.permute(0, 2, 1, 3).reshape(3, 9, 64)
        torch.testing.assert_close(mod.self_attn.out_proj(concat), out, rtol=0, atol=1e-6)
    assert capture.attention_mask.tolist() == (~_padding()).long().tolist()


# --------------------------------------------------------------------------------------
# nn.MultiheadAttention alone: need_weights, average_attn_weights, batch_first, padding
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("need_weights, average_attn_weights", [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("padded", [True, False])
def test_multihead_attention_alone(tmp_path, need_weights, average_attn_weights, batch_first, padded):
    model = Attend(batch_first, need_weights, average_attn_weights).eval()
    x = torch.randn(3, 9, 32, generator=torch.Generator().manual_seed(3))
    x = x if batch_first else x.transpose(0, 1).contiguous()
    batch = {"x": x, "key_padding_mask": _padding()} if padded else x
    summary = record_activations(model, ModuleCapture.for_torch_attention(model), [batch], tmp_path / "m.h5", model_id="mha")
    assert summary.kind == ("text" if padded else "vision") and (summary.n_heads, summary.head_dim, summary.n_tokens) == (4, 8, 9)
    assert _measured(summary) <= 1e-6, _measured(summary)
    validate(tmp_path / "m.h5")


def test_unbatched_input(tmp_path):
    """An unbatched (N, E) input is one input (B = 1)."""
    model = Attend().eval()
    s = record_activations(model, ModuleCapture.for_torch_attention(model), [torch.randn(9, 32)], tmp_path / "s.h5", model_id="unbatched")
    assert (s.n_inputs, s.n_tokens) == (1, 9) and _measured(s) <= 1e-6


# --------------------------------------------------------------------------------------
# The invariant stays meaningful
# --------------------------------------------------------------------------------------


def test_a_tampered_q_is_refused(tmp_path):
    enc = _encoder()

    def tampered(m, args, kwargs):  # q of another scale: the logits the module did not compute
        q, k, v = F.linear(args[0], m.in_proj_weight, m.in_proj_bias).chunk(3, dim=-1)
        b, n, _ = args[0].shape
        q, k, v = (t.reshape(b, n, m.num_heads, -1).transpose(1, 2) for t in (q, k, v))
        return 1.5 * q, k, v

    with pytest.raises(CaptureMismatchError) as info:
        record_activations(enc, ModuleCapture([layer.self_attn for layer in enc.layers], tampered), [_src(True)], tmp_path / "bad.h5", model_id="tampered")
    measured = float(re.search(r"= ([0-9.e+-]+) x max \|v\|", str(info.value)).group(1))
    assert measured > 1e-2 and not list(tmp_path.iterdir())


def test_a_mismatched_mask_is_refused(tmp_path):
    """The model pads keys, the file is told every token is real: the invariant fails."""
    enc = _encoder()
    batch = {"src": _src(True), "pad": _padding(), "attention_mask": torch.ones(3, 9, dtype=torch.int64)}
    with pytest.raises(CaptureMismatchError, match="layer 0"):
        record_activations(enc, ModuleCapture.for_torch_attention(enc), [batch], tmp_path / "bad.h5", model_id="mask", forward=lambda m, b: m(b["src"], src_key_padding_mask=b["pad"]))
    assert not list(tmp_path.iterdir())


# --------------------------------------------------------------------------------------
# Errors: a hook that cannot fire, attention the format cannot store
# --------------------------------------------------------------------------------------


def test_an_out_proj_hook_names_the_module_why_and_what_to_use(tmp_path):
    enc = _encoder()
    capture = ModuleCapture([layer.self_attn for layer in enc.layers], h_input_of=lambda m: m.out_proj)
    with pytest.raises(HooksDidNotFireError) as info:
        record_activations(enc, capture, [_src(True)], tmp_path / "x.h5", model_id="enc")
    msg = str(info.value)
    assert "[(0, 'h'), (1, 'h')]" in msg and "'layers.0.self_attn.out_proj'" in msg and "'layers.1.self_attn.out_proj'" in msg
    assert "never calls out_proj as a module" in msg and "Leave h_input_of unset" in msg and "ModuleCapture.for_torch_attention(model)" in msg
    assert not capture.handles and not list(tmp_path.iterdir())


def test_a_module_outside_the_model_is_named(tmp_path):
    enc, other = _encoder(), _encoder(seed=1)
    capture = ModuleCapture([enc.layers[0].self_attn, other.layers[1].self_attn])
    with pytest.raises(HooksDidNotFireError, match=r"modules\[1\] \(not a sub-module of the model\): MultiheadAttention not called as a module"):
        record_activations(enc, capture, [_src(True)], tmp_path / "x.h5", model_id="enc")


@pytest.mark.parametrize(
    "build, call, needle",
    [
        (lambda: nn.MultiheadAttention(32, 4, add_bias_kv=True), None, "add_bias_kv=True"),
        (lambda: nn.MultiheadAttention(32, 4, add_zero_attn=True), None, "add_zero_attn=True"),
        (lambda: nn.MultiheadAttention(32, 4, batch_first=True), lambda m, x: m(x, x, x, attn_mask=nn.Transformer.generate_square_subsequent_mask(9)), "attn_mask or is_causal"),
        (lambda: nn.MultiheadAttention(32, 4, batch_first=True), lambda m, x: m(x, x.flip(1), x.flip(1)), "cross-attention"),
        (lambda: nn.MultiheadAttention(32, 4, batch_first=True, dropout=0.1).train(), lambda m, x: m(x, x, x), "call model.eval()"),
        (lambda: nn.MultiheadAttention(32, 4, batch_first=True), lambda m, x: m(x, x, x, key_padding_mask=torch.full((3, 9), -0.5)), "values other than 0 and -inf"),
    ],
)
def test_attention_the_format_cannot_store_is_refused(tmp_path, build, call, needle):
    torch.manual_seed(0)
    mha = build()
    x = torch.randn(3, 9, 32)
    with pytest.raises(UnsupportedArchitectureError, match=re.escape(needle)):
        record_activations(mha, ModuleCapture.for_torch_attention(mha), [x], tmp_path / "x.h5", model_id="mha", forward=call)
    assert not list(tmp_path.iterdir())


def test_qkv_is_required_for_other_modules():
    with pytest.raises(TypeError, match=r"needs a qkv function for modules\[0\]"):
        ModuleCapture([nn.Linear(4, 4)])
    with pytest.raises(UnsupportedArchitectureError, match="holds no nn.MultiheadAttention"):
        ModuleCapture.for_torch_attention(nn.Linear(4, 4))


# --------------------------------------------------------------------------------------
# docs/activations.md's example runs as written
# --------------------------------------------------------------------------------------


def test_the_documentation_example_runs(tmp_path, monkeypatch, capsys):
    text = (REPO / "docs" / "activations.md").read_text()
    block = text.split("<!-- example: torch-attention -->", 1)[1]
    code = re.search(r"```python\n(.*?)```", block, re.S).group(1)
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "docs/activations.md", "exec"), {"__name__": "__main__"})
    assert validate(tmp_path / "torch_encoder.h5").n_layers == 2
    printed = float(capsys.readouterr().out.split()[-1])
    assert printed <= 1e-6


def test_one_module_observed_twice_is_refused_and_nothing_is_left_open():
    enc = _encoder()
    capture = ModuleCapture([enc.layers[0].self_attn, enc.layers[0].self_attn])
    with pytest.raises(ValueError, match="already observed"):
        capture.__enter__()
    assert not capture.handles and not enc.layers[0].self_attn._forward_pre_hooks
