"""Figures 1 and 4: the training log (J_proj while a ViT trains), resumption, log readers, figures."""

from __future__ import annotations

import gzip
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
import timm
import torch
import yaml

from kpca_repro import projection
from kpca_repro.training.checkpoint import UntrustedCheckpointError, load_checkpoint, save_checkpoint
from kpca_repro.training.data import FASHION_MNIST_MEAN, FASHION_MNIST_STD, build_datasets, read_idx
from kpca_repro.training.figures import plot_figure1, plot_figure4
from kpca_repro.training.logs import BASE_LOG_COLUMNS, LOG_COLUMNS, RECON_METRICS, TOKEN_STATS, read_training_log, read_wandb_logs, training_curves
from kpca_repro.training.loop import train_run
from kpca_repro.training.model import RecordingAttention, build_model, reconstruction_metrics
from kpca_repro.training.summary import (
    ABLATION_COLUMNS,
    CLAIMS,
    CLAIMS_COLUMNS,
    claims_note,
    over_seeds,
    run_dir,
    run_logs,
    run_scale,
    scale_seeds,
    scale_setting,
    scale_tokens,
    token_ablation_markdown,
    token_ablation_table,
    training_claims,
    training_claims_markdown,
    with_seeds,
)
from kpca_repro.workflow.config_checks import resolve_scales
from kpca_tools.recorders import AttentionRecorder

from conftest import REPO, run_snakemake

TINY = dict(num_classes=10, img_size=8, patch_size=4, in_chans=1, depth=2, embed_dim=32)


def _tiny_model(num_heads=2, standardize_qk=True, seed=0, drop_path=0.0, depth=2):
    torch.manual_seed(seed)
    return build_model("vit_tiny_patch16_224", num_heads=num_heads, standardize_qk=standardize_qk, drop_path=drop_path, **{**TINY, "depth": depth})


def _scale(**overrides):
    with open(REPO / "config" / "config.yaml") as f:
        scale = resolve_scales(yaml.safe_load(f)["training"]["scales"])["small"]
    scale.update(n_train=None, n_val=None, img_size=8, patch_size=4, depth=2, embed_dim=32, epochs=2, batch_size=8, eval_batch_size=16, warmup_epochs=0)
    scale.update(overrides)
    return scale


def _synthetic_sets(n_train=40, n_val=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_train + n_val, 1, 8, 8, generator=g)
    y = torch.randint(0, 10, (n_train + n_val,), generator=g)
    x[:, :, : 1 + y.max()] += y[:, None, None, None].float()  # learnable signal
    ds = torch.utils.data.TensorDataset(x, y)
    return torch.utils.data.Subset(ds, range(n_train)), torch.utils.data.Subset(ds, range(n_train, n_train + n_val))


# --------------------------------------------------------------------------------------
# The attention and the logged quantities
# --------------------------------------------------------------------------------------


def test_recording_attention_without_standardization_is_timms_attention():
    torch.manual_seed(1)
    ref = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_heads=2, **TINY).eval()
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_heads=2, **TINY).eval()
    model.load_state_dict(ref.state_dict())
    for blk in model.blocks:
        blk.attn = RecordingAttention.from_timm(blk.attn, standardize_qk=False)
    x = torch.randn(3, 1, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("num_heads", [1, 4])
def test_logged_jproj_equals_a_direct_computation_from_the_attention_tensors(num_heads):
    """The logged value against q, k, v, h read by hooks on timm's qkv and proj Linear layers."""
    model = _tiny_model(num_heads=num_heads).eval()
    x = torch.randn(5, 1, 8, 8)
    with AttentionRecorder(model.blocks[i].attn for i in range(2)) as rec, torch.no_grad():
        model(x)
    logged = reconstruction_metrics(model, x, train_mode=False)
    per_layer, phis, hs = [], [], []
    for layer in range(2):
        cap = {t: v.double() for t, v in rec.captured[layer].items()}
        q, k = projection.standardize_tokens(cap["q"], eps=0.0), projection.standardize_tokens(cap["k"], eps=0.0)
        d = q.shape[-1]
        np.testing.assert_allclose((q * q).sum(-1).numpy(), d - 1, rtol=1e-9)  # unbiased std, no epsilon
        # h of the model is softmax(q k^T / sqrt(d)) v on the standardized q, k
        torch.testing.assert_close(cap["h"], projection.attention_output(q, k, cap["v"]), rtol=1e-4, atol=1e-5)
        phi = projection.feature_norm_sq(q, k, log_domain=True)  # float64, log domain: an independent path
        h_sq = (cap["h"] ** 2).sum(-1)
        e = (phi - h_sq).abs()
        per_layer.append([e.mean(), h_sq.mean(), phi.mean(), (e / (h_sq + 1e-8)).mean(), (e / (phi + 1e-8)).mean()])
        phis.append(phi.flatten())
        hs.append(h_sq.flatten())
    direct = np.mean(np.array(per_layer, dtype=float), axis=0)
    got = [logged[m] for m in ("error", "h_norms_ave", "phiq_norms_ave", "rel_error_wrt_h", "rel_error_wrt_phiq")]
    np.testing.assert_allclose(got, direct, rtol=2e-5)
    assert logged["error"] >= abs(logged["h_norms_ave"] - logged["phiq_norms_ave"]) - 1e-6  # mean|a-b| >= |mean a - mean b|
    # the token statistics: over every (layer, image, head, token) pooled, by torch's quantile in float64
    phi, h_sq = torch.cat(phis), torch.cat(hs)
    assert phi.numel() == 2 * 5 * num_heads * 5  # layers x images x heads x (4 patches + class token)
    for name, values in (("error", (phi - h_sq).abs()), ("h_norms", h_sq), ("phiq_norms", phi)):
        np.testing.assert_allclose([logged[f"{name}_median"], logged[f"{name}_q99"]], torch.quantile(values, torch.tensor([0.5, 0.99], dtype=values.dtype)).numpy(), rtol=1e-4)
        assert logged[f"{name}_median"] <= logged[f"{name}_q99"]
    assert abs(logged["phiq_above_h_frac"] - float((phi > h_sq).double().mean())) <= 1 / phi.numel()
    assert set(logged) == set(RECON_METRICS) | set(TOKEN_STATS)


def test_train_mode_forward_uses_drop_path_and_eval_mode_does_not():
    model = _tiny_model(drop_path=0.5, depth=3)  # block 0 has rate 0; block 1's drop-path changes block 2's input
    x = torch.randn(4, 1, 8, 8)
    torch.manual_seed(0)
    a = reconstruction_metrics(model, x, train_mode=True)
    torch.manual_seed(1)
    b = reconstruction_metrics(model, x, train_mode=True)
    assert a != b and model.training  # mode restored
    assert reconstruction_metrics(model, x, train_mode=False) == reconstruction_metrics(model, x, train_mode=False)


# --------------------------------------------------------------------------------------
# Training: a well-formed log, exact resumption
# --------------------------------------------------------------------------------------


def test_two_epochs_write_a_well_formed_log(tmp_path):
    train_set, val_set = _synthetic_sets()
    df = train_run(_tiny_model(), train_set, val_set, _scale(), tmp_path / "log.csv", tmp_path / "ck.pt", seed=0, device=torch.device("cpu"), fingerprint="f", progress=False)
    on_disk = pd.read_csv(tmp_path / "log.csv")
    assert list(on_disk.columns) == list(LOG_COLUMNS)
    assert list(on_disk["epoch"]) == [0, 1]
    assert np.isfinite(on_disk.to_numpy(float)).all()
    pd.testing.assert_frame_equal(on_disk, df, check_dtype=False, rtol=1e-8)
    assert ((on_disk["test_acc1"] >= 0) & (on_disk["test_acc5"] >= on_disk["test_acc1"]) & (on_disk["test_acc5"] <= 100)).all()
    for split in ("train", "test"):
        assert (on_disk[f"{split}_error"] >= (on_disk[f"{split}_h_norms_ave"] - on_disk[f"{split}_phiq_norms_ave"]).abs() - 1e-6).all()
        assert (on_disk[f"{split}_h_norms_ave"] > 0).all() and (on_disk[f"{split}_phiq_norms_ave"] > 0).all()
    for split in ("train", "test"):  # the token statistics: quantiles in order, a share in [0, 1]
        assert (on_disk[f"{split}_error_median"] <= on_disk[f"{split}_error_q99"]).all()
        assert (on_disk[f"{split}_h_norms_median"] <= on_disk[f"{split}_h_norms_q99"]).all() and (on_disk[f"{split}_phiq_norms_median"] <= on_disk[f"{split}_phiq_norms_q99"]).all()
        assert on_disk[f"{split}_phiq_above_h_frac"].between(0, 1).all()
    state = torch.load(tmp_path / "ck.pt", weights_only=True)  # tensors and plain values only
    assert state["epoch"] == 2 and state["fixed"]["train"].shape == (8, 1, 8, 8) and state["fixed"]["test"].shape == (16, 1, 8, 8)
    # the fixed "train" batch is batch index 2 of the first epoch; "test" the first validation batch
    torch.testing.assert_close(state["fixed"]["test"], torch.stack([val_set[i][0] for i in range(16)]))


def test_a_rerun_and_an_interrupted_run_give_the_same_log(tmp_path):
    """On one machine, a second run from scratch, and a run stopped after epoch 1 (a stray row
    left behind) then restarted from its checkpoint, give the same bytes as one run; another
    seed does not (the check can fail)."""
    train_set, val_set = _synthetic_sets()
    scale = _scale(epochs=3, mixup=0.8, cutmix=1.0, model_ema=True, model_ema_decay=0.9)  # timm's Mixup, SoftTargetCE, EMA
    kw = dict(seed=3, device=torch.device("cpu"), fingerprint="f", progress=False)
    train_run(_tiny_model(), train_set, val_set, scale, tmp_path / "full.csv", tmp_path / "full.pt", **kw)
    assert list(pd.read_csv(tmp_path / "full.csv").columns) == list(LOG_COLUMNS)  # the token statistics included
    train_run(_tiny_model(), train_set, val_set, scale, tmp_path / "again.csv", tmp_path / "again.pt", **kw)
    assert (tmp_path / "again.csv").read_bytes() == (tmp_path / "full.csv").read_bytes()
    train_run(_tiny_model(), train_set, val_set, scale, tmp_path / "other.csv", tmp_path / "other.pt", **{**kw, "seed": 4})
    assert (tmp_path / "other.csv").read_bytes() != (tmp_path / "full.csv").read_bytes()

    class Killed(Exception):
        pass

    def kill(epoch, row):
        if epoch == 0:
            raise Killed

    with pytest.raises(Killed):
        train_run(_tiny_model(), train_set, val_set, scale, tmp_path / "part.csv", tmp_path / "part.pt", on_epoch_end=kill, **kw)
    assert len(pd.read_csv(tmp_path / "part.csv")) == 1
    with open(tmp_path / "part.csv", "a") as f:  # a row written after the checkpoint, then killed
        f.write(open(tmp_path / "part.csv").read().splitlines()[-1] + "\n")
    train_run(_tiny_model(seed=99), train_set, val_set, scale, tmp_path / "part.csv", tmp_path / "part.pt", **kw)
    assert (tmp_path / "part.csv").read_bytes() == (tmp_path / "full.csv").read_bytes()


def test_a_checkpoint_of_another_configuration_is_not_resumed(tmp_path):
    train_set, val_set = _synthetic_sets()
    kw = dict(seed=0, device=torch.device("cpu"), progress=False)
    train_run(_tiny_model(), train_set, val_set, _scale(epochs=1), tmp_path / "a.csv", tmp_path / "ck.pt", fingerprint="old", **kw)
    train_run(_tiny_model(), train_set, val_set, _scale(epochs=1), tmp_path / "b.csv", tmp_path / "ck.pt", fingerprint="new", **kw)
    assert (tmp_path / "a.csv").read_bytes() == (tmp_path / "b.csv").read_bytes()  # trained afresh, not "already done"
    assert torch.load(tmp_path / "ck.pt", weights_only=True)["fingerprint"] == "new"


class _Payload:
    """Unpickling this runs ``Path.touch(marker)``: what a crafted checkpoint could do with any code."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        from pathlib import Path

        return (Path.touch, (Path(self.marker),))


def test_a_checkpoint_carrying_a_pickled_object_is_refused_and_the_run_starts_afresh(tmp_path, caplog):
    """A valid checkpoint with one pickled object added: load_checkpoint refuses it naming the
    file and the object, runs none of its code, and train_run trains from epoch 0 (the same
    log as a fresh run) and replaces it with a checkpoint of tensors and plain values."""
    import pickle

    train_set, val_set = _synthetic_sets()
    kw = dict(seed=0, device=torch.device("cpu"), fingerprint="f", progress=False)
    train_run(_tiny_model(), train_set, val_set, _scale(epochs=1), tmp_path / "fresh.csv", tmp_path / "fresh.pt", **kw)
    marker = tmp_path / "code-ran"
    state = load_checkpoint(tmp_path / "fresh.pt")
    state["rows"][0]["note"] = _Payload(marker)
    torch.save(state, tmp_path / "ck.pt")
    torch.load(tmp_path / "ck.pt", weights_only=False)  # the payload is real: an unrestricted load runs it
    assert marker.exists()
    marker.unlink()
    with pytest.raises(UntrustedCheckpointError, match=r"ck\.pt: refused to load the training checkpoint: torch\.load\(weights_only=True\) rejects it \(Unsupported global") as err:
        load_checkpoint(tmp_path / "ck.pt")
    assert isinstance(err.value.__cause__, pickle.UnpicklingError) and not marker.exists()
    with caplog.at_level("WARNING", logger="kpca_repro.training.checkpoint"):
        train_run(_tiny_model(), train_set, val_set, _scale(epochs=1), tmp_path / "log.csv", tmp_path / "ck.pt", **kw)
    assert not marker.exists() and "refused to load" in caplog.text and "training from epoch 0" in caplog.text
    assert (tmp_path / "log.csv").read_bytes() == (tmp_path / "fresh.csv").read_bytes()
    assert "note" not in load_checkpoint(tmp_path / "ck.pt")["rows"][0]  # overwritten by a plain one
    (tmp_path / "ck.pt").write_bytes(b"not a checkpoint")  # a damaged file is not trusted either
    with pytest.raises(UntrustedCheckpointError, match="ck.pt"):
        load_checkpoint(tmp_path / "ck.pt")


def test_a_checkpoint_that_would_not_load_back_is_not_written(tmp_path):
    state = {"fingerprint": "f", "epoch": 1, "rows": [{"lr": np.float64(0.1)}], "fixed": {}, "model": {}}
    with pytest.raises(TypeError, match=r"state\['rows'\]\[0\]\['lr'\] is a numpy.float64"):
        save_checkpoint(tmp_path / "ck.pt", state)
    assert not (tmp_path / "ck.pt").exists()
    state["rows"][0]["lr"] = 0.1
    save_checkpoint(tmp_path / "ck.pt", state)
    assert load_checkpoint(tmp_path / "ck.pt")["rows"] == [{"lr": 0.1}]


# --------------------------------------------------------------------------------------
# Data and log readers
# --------------------------------------------------------------------------------------


def _write_idx(path, arr):
    header = bytes([0, 0, 0x08, arr.ndim]) + b"".join(int(n).to_bytes(4, "big") for n in arr.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + arr.astype(np.uint8).tobytes())


def write_fashion_mnist(root, n_train=48, n_test=32, seed=0):
    """A Fashion-MNIST-shaped folder of random IDX .gz files; returns the arrays written."""
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    arrays = {}
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        arrays[prefix] = (rng.integers(0, 256, (n, 28, 28)), rng.integers(0, 10, n))
        _write_idx(root / f"{prefix}-images-idx3-ubyte.gz", arrays[prefix][0])
        _write_idx(root / f"{prefix}-labels-idx1-ubyte.gz", arrays[prefix][1])
    return arrays


def test_fashion_mnist_reads_the_gz_idx_files_in_place(tmp_path):
    arrays = write_fashion_mnist(tmp_path / "datasets" / "fashion-mnist")
    scale = _scale(n_train=20, n_val=None, img_size=28, augment=False)
    train_set, val_set, num_classes, in_chans = build_datasets(scale, tmp_path)
    assert (len(train_set), len(val_set), num_classes, in_chans) == (20, 32, 10, 1)
    x, y = train_set[3]
    assert x.shape == (1, 28, 28) and y == arrays["train"][1][3]
    expected = (arrays["train"][0][3] / 255.0 - FASHION_MNIST_MEAN) / FASHION_MNIST_STD
    np.testing.assert_allclose(x[0].numpy(), expected, rtol=1e-5, atol=1e-5)
    assert not list((tmp_path / "datasets" / "fashion-mnist").glob("*ubyte")) and not (tmp_path / "datasets" / "fashion-mnist" / "FashionMNIST").exists()
    with gzip.open(tmp_path / "bad.gz", "wb") as f:
        f.write(bytes([0, 0, 8, 1]) + (10).to_bytes(4, "big") + b"\x00" * 3)
    with pytest.raises(ValueError, match="bad.gz"):
        read_idx(tmp_path / "bad.gz")


def test_missing_fashion_mnist_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="fashion-mnist/train-images-idx3-ubyte.gz"):
        build_datasets(_scale(), tmp_path)


def write_wandb(root, model="vit_tiny", run="reconstruction_vit", n=12):
    """Synthetic W&B exports: 15 steps per epoch, then 17 from epoch 8 (the drift of docs/method.md 6.2)."""
    step0 = {"train_error": 2, "train_h_norms_ave": 5, "train_phiq_norms_ave": 6, "train_rel_error_wrt_h": 3, "train_rel_error_wrt_phiq": 4}
    step0.update({k.replace("train", "test"): v + 8 for k, v in step0.items()})
    steps = np.array([15 * min(e, 8) + 17 * max(e - 8, 0) for e in range(n)])
    (root / model).mkdir(parents=True, exist_ok=True)
    for metric, offset in step0.items():
        values = np.linspace(10, 1, n) + offset / 100
        col = f"{run} - {metric}"
        df = pd.DataFrame({"Step": steps + offset, col: values, f"{col}__MIN": values, f"{col}__MAX": values})
        df.iloc[::-1].to_csv(root / model / f"{metric}.csv", index=False, quoting=1)  # unsorted on purpose
    return steps


def test_wandb_reader_maps_rows_to_epochs_and_steps_over_15(tmp_path):
    steps = write_wandb(tmp_path)
    curves = read_wandb_logs(tmp_path)
    assert set(curves["metric"]) == set(RECON_METRICS) and set(curves["split"]) == {"train", "test"}
    assert set(curves["model"]) == {"vit_tiny"} and len(curves) == 10 * 12
    err = curves[(curves["metric"] == "error") & (curves["split"] == "train")].sort_values("epoch")
    assert list(err["epoch"]) == list(range(12))
    np.testing.assert_allclose(err["x"], (steps + 2) / 15)
    np.testing.assert_allclose(err["value"], np.linspace(10, 1, 12) + 0.02)
    assert err["x"].iloc[-1] - err["epoch"].iloc[-1] > 0.5  # the drift is kept on the "step" axis
    rows = read_wandb_logs(tmp_path, epoch_axis="row")
    assert (rows["x"] == rows["epoch"]).all()
    (tmp_path / "vit_tiny" / "junk.csv").write_text('"Step","a - b"\n1,2\n')
    with pytest.raises(ValueError, match="junk.csv"):
        read_wandb_logs(tmp_path)


def test_the_log_readers_and_the_figures_import_no_torch():
    """Rule figure_training reads the logs and draws the figures: kpca_repro.training.logs,
    .figures and .summary load neither torch nor timm (the model, data and loop modules do)."""
    code = (
        "import sys\n"
        "import kpca_repro.training.figures, kpca_repro.training.logs, kpca_repro.training.summary\n"
        "heavy = sorted(m for m in ('torch', 'timm') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, env={**__import__("os").environ, "PYTHONPATH": str(REPO / "src")})


def test_figures_from_a_log_and_wandb_exports(tmp_path):
    write_wandb(tmp_path / "ref")
    train_set, val_set = _synthetic_sets()
    train_run(_tiny_model(), train_set, val_set, _scale(), tmp_path / "log.csv", tmp_path / "ck.pt", seed=0, device=torch.device("cpu"), fingerprint="f", progress=False)
    curves = training_curves([(tmp_path / "log.csv", "deit_tiny", "ours")], tmp_path / "ref", reference_source="ref")
    plotted = plot_figure1(curves, tmp_path / "f1.pdf", tmp_path / "f1.png", {"ref": 3}, {"ours": scale_setting(_scale()), "ref": "ImageNet"})
    assert (tmp_path / "f1.pdf").read_bytes()[:4] == b"%PDF" and (tmp_path / "f1.png").stat().st_size > 10_000
    assert plotted[plotted["source"] == "ref"]["x"].min() >= 3 and plotted[plotted["source"] == "ours"]["x"].min() == 0
    means, medians = {"error", "h_norms_ave", "phiq_norms_ave"}, {"error_median", "h_norms_median", "phiq_norms_median"}
    assert set(plotted[plotted["source"] == "ref"]["metric"]) == means  # the authors log means only
    assert set(plotted[plotted["source"] == "ours"]["metric"]) == means | medians
    curves.loc[curves["metric"] == "rel_error_wrt_phiq", "value"] *= 1e6
    rel = plot_figure4(curves, tmp_path / "f4.pdf", tmp_path / "f4.png", {"ref": 3})
    bottom = rel[rel["panel"] == "rel_phi"]
    np.testing.assert_allclose(bottom["plotted"], bottom["value"])  # drawn as they are, on a log axis
    assert rel[(rel["panel"] == "rel_h") & (rel["source"] == "ref")]["x"].min() >= 3
    assert bottom[bottom["source"] == "ref"]["x"].min() < 3  # the lower panel keeps every epoch


def _synthetic_log(path, epochs=5, seed=0, columns=LOG_COLUMNS):
    """A log of random positive values (epochs 0..epochs-1) with the given columns; returns it."""
    rng = np.random.default_rng(seed)
    log = pd.DataFrame(rng.uniform(0.1, 100, size=(epochs, len(columns))), columns=list(columns))
    log["epoch"] = np.arange(epochs)
    log.to_csv(path, index=False)
    return log


def test_seeds_are_drawn_as_their_median_and_range_and_old_logs_without_medians_still_plot(tmp_path):
    """Three seeds of one run become one curve: per epoch the median over seeds, and the
    smallest and largest seed's value; a log written before the token statistics were logged
    reads and plots, without medians."""
    logs = [_synthetic_log(tmp_path / f"s{seed}.csv", seed=seed) for seed in range(3)]
    _synthetic_log(tmp_path / "old.csv", seed=7, columns=BASE_LOG_COLUMNS)
    runs = [(tmp_path / f"s{seed}.csv", "vit_tiny", "ours", seed) for seed in range(3)] + [(tmp_path / "old.csv", "deit_tiny", "old", 0)]
    curves = training_curves(runs, None)
    assert sorted(curves[curves["source"] == "ours"]["seed"].unique()) == [0, 1, 2]
    assert not curves[curves["source"] == "old"]["metric"].isin(TOKEN_STATS).any()
    summary = over_seeds(curves)
    ours = summary[(summary["source"] == "ours") & (summary["split"] == "test")]
    for metric in ("error", "phiq_norms_median"):
        values = np.stack([log[f"test_{metric}"].to_numpy() for log in logs])  # (seed, epoch)
        got = ours[ours["metric"] == metric].sort_values("epoch")
        np.testing.assert_array_equal(got["value"], np.median(values, axis=0))
        np.testing.assert_array_equal(got["value_min"], values.min(0))
        np.testing.assert_array_equal(got["value_max"], values.max(0))
        assert (got["n_seeds"] == 3).all() and list(got["x"]) == list(range(5))
    notes = {"ours": "claims: a note under the column"}
    plotted = plot_figure1(curves, tmp_path / "f1.pdf", tmp_path / "f1.png", {}, {"ours": "three seeds", "old": "one old log"}, notes)
    assert (tmp_path / "f1.png").stat().st_size > 10_000
    assert set(plotted[plotted["source"] == "old"]["metric"]) == {"error", "h_norms_ave", "phiq_norms_ave"}
    assert (plotted["value_min"] <= plotted["value"]).all() and (plotted["value"] <= plotted["value_max"]).all()
    rel = plot_figure4(curves, tmp_path / "f4.pdf", tmp_path / "f4.png", {})
    assert (rel[rel["source"] == "ours"]["n_seeds"] == 3).all() and (rel["value_min"] <= rel["plotted"]).all() and (rel["plotted"] <= rel["value_max"]).all()
    with pytest.raises(ValueError, match="old.csv: not a training log"):
        pd.read_csv(tmp_path / "old.csv").drop(columns="test_error").to_csv(tmp_path / "old.csv", index=False)
        read_training_log(tmp_path / "old.csv", "deit_tiny", "old")


# --------------------------------------------------------------------------------------
# The rules end to end
# --------------------------------------------------------------------------------------


def _training_config(path, resources, **figure1):
    cfg = {
        "resources_dir": str(resources),
        "offline": True,
        "vision": {"models": ["vit_tiny_patch16_224"], "n_images": 2, "batch_size": 2},
        "training": {
            "threads": 1,
            "scales": {"small": {"n_train": 24, "n_val": 16, "img_size": 8, "patch_size": 4, "depth": 1, "embed_dim": 48, "epochs": 2, "batch_size": 8, "eval_batch_size": 8}},
        },
        "figure1": figure1,
    }
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.integration
def test_figures_1_and_4_end_to_end(tmp_path):
    res = tmp_path / "res"
    write_fashion_mnist(res / "datasets" / "fashion-mnist")
    write_wandb(tmp_path / "ref", "vit_tiny")
    write_wandb(tmp_path / "ref", "deit_tiny", run="reconstruction_deit")
    cfg = _training_config(tmp_path / "c.yaml", res, reference_logs=str(tmp_path / "ref"), runs=["deit_tiny_small"])
    run_snakemake(tmp_path, "results/figure1.pdf", "results/figure4.pdf", "--configfile", str(cfg))
    run = tmp_path / "results" / "training" / "deit_tiny_small" / "seed0"  # small: training.seeds, one seed
    assert [p.name for p in run.parent.iterdir()] == ["seed0"]
    log = pd.read_csv(run / "log.csv")
    assert list(log["epoch"]) == [0, 1] and np.isfinite(log.to_numpy(float)).all() and list(log.columns) == list(LOG_COLUMNS)
    state = load_checkpoint(run / "checkpoint.pt")
    assert state["epoch"] == 2 and state["model"]["blocks.0.attn.qkv.weight"].shape == (3 * 48, 48)
    assert [blk.attn.num_heads for blk in build_model("deit_tiny_patch16_224", num_heads=6, standardize_qk=True, **{**TINY, "depth": 1, "embed_dim": 48}).blocks] == [6]
    fig1 = pd.read_csv(tmp_path / "results" / "figure1.csv")
    assert set(fig1["model"]) == {"vit_tiny", "deit_tiny"} and fig1["source"].nunique() == 2
    assert (tmp_path / "results" / "figure4.png").stat().st_size > 10_000
    assert (tmp_path / "benchmarks" / "train" / "deit_tiny_small_seed0.tsv").exists()
    # the claims table of Figure 1: its runs, both splits and statistics, counted over the logged epochs
    claims = pd.read_csv(tmp_path / "results" / "training_claims.csv")
    assert set(claims["model"]) == {"deit_tiny"} and set(claims["split"]) == {"train", "test"} and set(claims["statistic"]) == {"mean", "median"}
    every = claims[claims["scope"] == "every epoch"]
    assert (every["total"] == 2).all() and (claims["holds"] <= claims["total"]).all()
    small = log["test_phiq_norms_ave"] < 0.1 * log["test_h_norms_ave"]
    row = every[(every["claim"] == "phiq_much_smaller_than_h") & (every["statistic"] == "mean") & (every["split"] == "test")].iloc[0]
    assert row["holds"] == small.sum()
    assert "| ‖φ(q)‖² ≪ ‖h‖² |" in (tmp_path / "results" / "training_claims.md").read_text()
    # the log lost (Snakemake deletes the output of a killed job): the rerun resumes from the checkpoint
    before = (run / "log.csv").read_bytes()
    (run / "log.csv").unlink()
    run_snakemake(tmp_path, "results/training/deit_tiny_small/seed0/log.csv", "--configfile", str(cfg))
    assert "resuming" in (tmp_path / "logs" / "train" / "deit_tiny_small_seed0.log").read_text()
    assert (run / "log.csv").read_bytes() == before


@pytest.mark.parametrize(
    "figure1, needle",
    [({"runs": ["vit_tiny_huge"]}, "figure1.runs[0]"), ({"reference_logs": "/nonexistent/logs"}, "figure1.reference_logs"), ({"epoch_axis": "steps"}, "epoch_axis")],
)
def test_bad_training_configuration_stops_the_workflow(figure1, needle, tmp_path):
    """The parse of `snakemake results/figure1.pdf --configfile c.yaml` stops naming the key
    (conftest.parse_stop: the calls of workflow/rules/common.smk; through Snakemake, before any
    job, in tests/test_reliability.py)."""
    from conftest import parse_stop, workflow_config

    (tmp_path / "ref").mkdir()
    figure1.setdefault("reference_logs", str(tmp_path / "ref"))
    # the tiny `small` scale (8x8 images) is valid for small's runs, not for the default
    # runs' medium-n17 (7x7 patches): each case has exactly one error, the one it names
    figure1.setdefault("runs", ["deit_tiny_small"])
    cfg = _training_config(tmp_path / "c.yaml", tmp_path, **figure1)
    message = parse_stop(workflow_config(cfg))
    assert message is not None and needle in message, message


# --------------------------------------------------------------------------------------
# Scales and the token-count ablation
# --------------------------------------------------------------------------------------


def test_scale_tokens_and_setting():
    scale = _scale(img_size=28, patch_size=2, n_train=3072, depth=6, epochs=10, dataset="fashion_mnist")
    assert scale_tokens(scale) == 197 and scale_tokens({**scale, "patch_size": 4}) == 50 and scale_tokens({**scale, "patch_size": 7}) == 17
    assert scale_tokens({**scale, "img_size": 224, "patch_size": 16}) == 197
    assert scale_setting(scale) == "Fashion-MNIST, 3072 images, 28x28 in 2x2 patches: 197 tokens, 6 blocks, 10 epochs"
    assert scale_setting({**scale, "n_train": None, "depth": None}).startswith("Fashion-MNIST, all images,")
    with pytest.raises(ValueError, match="does not divide"):
        scale_tokens({**scale, "patch_size": 3})


def test_token_ablation_table_takes_the_first_and_last_epoch_of_each_log(tmp_path):
    rng = np.random.default_rng(0)
    runs = []
    for tokens in (197, 17):
        log = pd.DataFrame(rng.uniform(0.1, 100, size=(5, len(LOG_COLUMNS))), columns=list(LOG_COLUMNS))
        log["epoch"] = [3, 0, 4, 1, 2]  # rows in any order: first and last are by epoch
        log.to_csv(tmp_path / f"{tokens}.csv", index=False)
        runs.append((tmp_path / f"{tokens}.csv", "vit_tiny", f"s{tokens}", tokens))
    table = token_ablation_table(runs)
    assert list(table.columns) == list(ABLATION_COLUMNS) and len(table) == 4
    assert list(table["tokens"]) == [17, 17, 197, 197] and list(table["split"]) == ["test", "train"] * 2
    for _, row in table.iterrows():
        log = pd.read_csv(tmp_path / f"{row['tokens']}.csv").set_index("epoch")
        split = row["split"]
        assert row["epochs"] == 5
        assert row["j_proj_first"] == log.loc[0, f"{split}_error"] and row["j_proj_last"] == log.loc[4, f"{split}_error"]
        assert row["h_norm_sq_first"] == log.loc[0, f"{split}_h_norms_ave"] and row["h_norm_sq_last"] == log.loc[4, f"{split}_h_norms_ave"]
        assert row["phiq_norm_sq_first"] == log.loc[0, f"{split}_phiq_norms_ave"] and row["phiq_norm_sq_last"] == log.loc[4, f"{split}_phiq_norms_ave"]
        assert row["train_loss_last"] == log.loc[4, "train_loss"] and row["test_acc1_last"] == log.loc[4, "test_acc1"]
    md = token_ablation_markdown(table, "test", {"vit_tiny": "ViT-Tiny"})
    assert md.count("| ViT-Tiny |") == 2 and md.index("| ViT-Tiny | 17 |") < md.index("| ViT-Tiny | 197 |")
    (tmp_path / "empty.csv").write_text(",".join(LOG_COLUMNS) + "\n")
    with pytest.raises(ValueError, match="no epochs"):
        token_ablation_table([(tmp_path / "empty.csv", "m", "s", 5)])


def test_token_ablation_table_gives_the_median_and_range_over_seeds(tmp_path):
    logs = [_synthetic_log(tmp_path / f"s{seed}.csv", seed=seed) for seed in (2, 0, 1)]
    _synthetic_log(tmp_path / "old.csv", seed=9, columns=BASE_LOG_COLUMNS)
    runs = [(tmp_path / f"s{seed}.csv", "vit_tiny", "medium", 197, seed) for seed in (2, 0, 1)] + [(tmp_path / "old.csv", "deit_tiny", "medium", 197, 0)]
    table = token_ablation_table(runs)
    row = table[(table["model"] == "vit_tiny") & (table["split"] == "test")].iloc[0]
    assert row["n_seeds"] == 3 and row["seeds"] == "0 1 2" and row["epochs"] == 5
    for name, column in (("j_proj", "test_error"), ("phiq_norm_sq_median", "test_phiq_norms_median"), ("h_norm_sq_q99", "test_h_norms_q99")):
        for when, at in (("first", 0), ("last", -1)):
            values = [log[column].iloc[at] for log in logs]
            assert (row[f"{name}_{when}"], row[f"{name}_{when}_min"], row[f"{name}_{when}_max"]) == (np.median(values), min(values), max(values))
    assert row["test_acc1_last"] == np.median([log["test_acc1"].iloc[-1] for log in logs])
    old = table[(table["model"] == "deit_tiny") & (table["split"] == "test")].iloc[0]
    assert np.isnan(old["phiq_norm_sq_median_last"]) and old["j_proj_last"] == old["j_proj_last_min"] == pd.read_csv(tmp_path / "old.csv")["test_error"].iloc[-1]
    md = token_ablation_markdown(table, "test", {"vit_tiny": "ViT-Tiny", "deit_tiny": "DeiT-Tiny"})
    vit = next(line for line in md.splitlines() if line.startswith("| ViT-Tiny"))
    assert f"{row['j_proj_last']:.3g} [{row['j_proj_last_min']:.3g}–{row['j_proj_last_max']:.3g}]" in vit
    deit = next(line for line in md.splitlines() if line.startswith("| DeiT-Tiny"))
    assert deit.endswith("| – → – |") and "[" not in deit  # one seed: no range; no medians: a dash
    _synthetic_log(tmp_path / "s1.csv", epochs=4, seed=1)  # an unfinished seed
    with pytest.raises(ValueError, match="different numbers of epochs"):
        token_ablation_table(runs)
    with pytest.raises(ValueError, match="seed 0 of vit_tiny_medium given twice"):
        token_ablation_table([runs[1], runs[1]])


def _claims_log(path, j, h, phi, columns=LOG_COLUMNS, statistic_columns=("error", "h_norms_ave", "phiq_norms_ave")):
    """A log whose test and train J, h and phi columns (of the given statistic) are the given per-epoch values."""
    log = pd.DataFrame({c: np.ones(len(j)) for c in columns})
    log["epoch"] = np.arange(len(j))
    for split in ("train", "test"):
        for name, values in zip(statistic_columns, (j, h, phi)):
            if f"{split}_{name}" in log.columns:
                log[f"{split}_{name}"] = values
    log.to_csv(path, index=False)


def test_training_claims_count_the_seeds_and_epochs_where_each_definition_holds(tmp_path):
    h = np.full(6, 10.0)
    # seed 0: phi/h = 0.05, 0.1 (not strictly below), 0.2, 0.01, nan, 0.05; J/h = 1.4, 1/1.6, 1.6, 1, 1, 1 -> J falls overall, not in the 2nd half
    _claims_log(tmp_path / "a.csv", j=h * [1.4, 1 / 1.6, 1.6, 1, 1, 1], h=h, phi=h * [0.05, 0.1, 0.2, 0.01, np.nan, 0.05])
    # seed 1: J rises then falls in the second half; phi always small; J/h = 0.5 then 1.2
    _claims_log(tmp_path / "b.csv", j=h * [0.5, 0.5, 0.5, 1.2, 1.2, 1.1], h=h, phi=h * 0.001)
    runs = [(tmp_path / "a.csv", "vit_tiny", "medium", 197, 0), (tmp_path / "b.csv", "vit_tiny", "medium", 197, 1)]
    claims = training_claims(runs)
    assert list(claims.columns) == list(CLAIMS_COLUMNS) and len(claims) == 2 * len(CLAIMS) * 2  # splits x claims x statistics

    def get(claim, scope, statistic="mean", split="test", frame=claims):
        r = frame[(frame["claim"] == claim) & (frame["scope"] == scope) & (frame["statistic"] == statistic) & (frame["split"] == split)]
        return int(r["holds"].iloc[0]), int(r["total"].iloc[0])

    assert get("phiq_much_smaller_than_h", "every epoch") == (3 + 6, 12)  # 0.05, 0.01, 0.05 of seed 0; every epoch of seed 1
    assert get("phiq_much_smaller_than_h", "last epoch") == (2, 2)
    assert get("jproj_close_to_h", "every epoch") == (4 + 3, 12)  # seed 0: 1.4, 1, 1, 1 (a NaN phi does not matter here); seed 1: 1.2, 1.2, 1.1
    assert get("jproj_close_to_h", "last epoch") == (2, 2)
    assert get("jproj_falls", "whole run") == (1, 2)  # seed 0: 10 < 14; seed 1: 11 > 5
    assert get("jproj_falls_second_half", "whole run") == (1, 2)  # against epoch 3: seed 0: 10 = 10; seed 1: 11 < 12
    assert get("phiq_much_smaller_than_h", "every epoch", split="train") == get("phiq_much_smaller_than_h", "every epoch")
    # these logs' median columns are ones: phi = h, never small; J = h, always close
    assert get("phiq_much_smaller_than_h", "every epoch", "median") == (0, 12) and get("jproj_close_to_h", "every epoch", "median") == (12, 12)
    # the thresholds and the epochs counted are parameters
    wider = training_claims(runs, phiq_ratio_below=0.3, jproj_h_factor=1.7, skip_epochs=2)
    assert get("phiq_much_smaller_than_h", "every epoch", frame=wider) == (3 + 4, 8) and get("jproj_close_to_h", "every epoch", frame=wider) == (4 + 3, 8)
    assert get("jproj_falls", "whole run", frame=wider) == (1, 2)  # from epoch 2: seed 0 16 -> 10, seed 1 5 -> 11
    with pytest.raises(ValueError, match="jproj_h_factor > 1"):
        training_claims(runs, jproj_h_factor=1.0)
    # a log without the medians: the median statistic is "not logged", the mean still counted
    _claims_log(tmp_path / "old.csv", j=h, h=h, phi=h * 0.01, columns=BASE_LOG_COLUMNS)
    old = training_claims([(tmp_path / "old.csv", "deit_tiny", "small", 17, 0)])
    assert get("jproj_close_to_h", "every epoch", frame=old) == (6, 6) and get("jproj_close_to_h", "every epoch", "median", frame=old) == (0, 0)
    assert old[old["statistic"] == "median"]["fraction"].isna().all()
    md = training_claims_markdown(pd.concat([claims, old]), "test", {"vit_tiny": "ViT-Tiny"})
    assert "| ViT-Tiny | medium | 197 | ‖φ(q)‖² ≪ ‖h‖² | (seed, epoch) pairs | 9/12 (75 %) | 0/12 (0 %) |" in md
    assert "| deit_tiny | small | 17 | J_proj ≈ ‖h‖² | (seed, epoch) pairs | 6/6 (100 %) | not logged |" in md
    note = claims_note(claims, "medium", names={"vit_tiny": "ViT-Tiny"})
    assert "ViT-Tiny: ‖φ(q)‖² ≪ ‖h‖² 9/12 | 0/12; J_proj ≈ ‖h‖² 7/12 | 12/12; J_proj falls 1/2 | 0/2" in note
    assert claims_note(claims, "small") == ""


def test_seeds_belong_to_scales_and_stay_out_of_what_a_run_trains():
    cfg = yaml.safe_load((REPO / "config" / "config.yaml").read_text())["training"]
    cfg["scales"] = resolve_scales(cfg["scales"])
    assert scale_seeds(cfg, "medium") == [0, 1, 2] and scale_seeds(cfg, "medium-n17-long") == scale_seeds(cfg, "medium-n50") == [0, 1, 2]
    assert scale_seeds(cfg, "small") == cfg["seeds"] == [0]  # no `seeds` of its own: training.seeds
    assert scale_seeds({**cfg, "seeds": [5, 3]}, "small") == [5, 3] and scale_seeds({"scales": {"s": {}}}, "s") == [0]
    assert "seeds" not in run_scale(cfg["scales"]["medium"]) and run_scale(cfg["scales"]["medium"]) == run_scale(cfg["scales"]["small"]) | {"n_train": 3072, "patch_size": 2}
    assert run_dir("vit_tiny", "medium", 2) == "results/training/vit_tiny_medium/seed2"
    runs = with_seeds(cfg, [("vit_tiny", "medium", 197), ("deit_tiny", "small", 17)])
    assert runs == [("vit_tiny", "medium", 197, 0), ("vit_tiny", "medium", 197, 1), ("vit_tiny", "medium", 197, 2), ("deit_tiny", "small", 17, 0)]
    assert run_logs(runs)[1:] == ["results/training/vit_tiny_medium/seed1/log.csv", "results/training/vit_tiny_medium/seed2/log.csv", "results/training/deit_tiny_small/seed0/log.csv"]
    assert scale_setting(cfg["scales"]["medium"], [0, 1, 2]).endswith("10 epochs, 3 seeds (0, 1, 2)") and scale_setting(cfg["scales"]["small"], [0]).endswith(", seed 0")


@pytest.mark.integration
def test_token_ablation_end_to_end_with_inherited_scales_and_resumption(tmp_path):
    """Two scales written as overrides of `small` (patch 4: 5 tokens, patch 2: 17 tokens on 8x8
    images) train with the token count their patches give, one of them with two seeds; the
    ablation table holds their logs' first and last epochs (the median and range over the
    seeds), and a lost log is rebuilt from the checkpoint."""
    res = tmp_path / "res"
    write_fashion_mnist(res / "datasets" / "fashion-mnist")
    cfg = yaml.safe_load(_training_config(tmp_path / "c.yaml", res, runs=[], use_reference=False).read_text())
    cfg["training"]["scales"].update({"t-n5": {"base": "small", "n_val": 8, "seeds": [0, 1]}, "t-n17": {"base": "t-n5", "patch_size": 2, "seeds": [0]}})
    cfg["token_ablation"] = {"models": ["vit_tiny"], "scales": ["t-n17", "t-n5"]}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    run_snakemake(tmp_path, "results/token_ablation.csv", "--configfile", str(tmp_path / "c.yaml"))
    table = pd.read_csv(tmp_path / "results" / "token_ablation.csv")
    assert list(table["tokens"]) == [5, 5, 17, 17] and list(table["scale"]) == ["t-n5", "t-n5", "t-n17", "t-n17"]
    assert list(table["n_seeds"]) == [2, 2, 1, 1]
    for scale, tokens, seeds in (("t-n5", 5, (0, 1)), ("t-n17", 17, (0,))):
        logs = []
        for seed in seeds:
            run = tmp_path / "results" / "training" / f"vit_tiny_{scale}" / f"seed{seed}"
            state = load_checkpoint(run / "checkpoint.pt")
            assert state["model"]["pos_embed"].shape == (1, tokens, 48)  # the inherited 8x8 images in this scale's patches
            logs.append(pd.read_csv(run / "log.csv"))
        row = table[(table["scale"] == scale) & (table["split"] == "test")].iloc[0]
        last = [log["test_error"].iloc[-1] for log in logs]
        np.testing.assert_allclose([row["j_proj_last"], row["j_proj_last_min"], row["j_proj_last_max"]], [np.median(last), min(last), max(last)], rtol=1e-5)
        np.testing.assert_allclose(row["phiq_norm_sq_median_first"], np.median([log["test_phiq_norms_median"].iloc[0] for log in logs]), rtol=1e-5)
    n5 = [pd.read_csv(tmp_path / "results" / "training" / "vit_tiny_t-n5" / f"seed{seed}" / "log.csv") for seed in (0, 1)]
    assert not np.allclose(n5[0]["test_error"], n5[1]["test_error"])  # two seeds, two runs
    assert "| ViT-Tiny | 17 |" in (tmp_path / "results" / "token_ablation.md").read_text()
    run = tmp_path / "results" / "training" / "vit_tiny_t-n17" / "seed0"
    before = (run / "log.csv").read_bytes()
    (run / "log.csv").unlink()
    run_snakemake(tmp_path, "results/training/vit_tiny_t-n17/seed0/log.csv", "--configfile", str(tmp_path / "c.yaml"))
    assert "resuming" in (tmp_path / "logs" / "train" / "vit_tiny_t-n17_seed0.log").read_text()
    assert (run / "log.csv").read_bytes() == before


@pytest.mark.integration
def test_training_docs_state_what_the_kept_logs_give():
    """docs/training.md's claims table and three-seed ablation table are the output of
    docs/training_runs/tables.py on the logs kept beside it (the runs the docs cite): a number
    edited by hand, or a log replaced, makes a row differ."""
    out = subprocess.run([sys.executable, str(REPO / "docs" / "training_runs" / "tables.py")], capture_output=True, text=True, check=True).stdout
    claims, ablation, ablation_claims = (block.splitlines() for block in out.strip().split("\n\n"))
    # the docs' claims table of the drawn runs leaves out the scale column (N names it)
    claims = {"|".join(c for i, c in enumerate(row.split("|")) if i != 2) for row in claims[2:]}
    docs = (REPO / "docs" / "training.md").read_text().splitlines()
    stated = [line for line in docs if line.startswith(("| ViT-Tiny |", "| DeiT-Tiny |")) and ("≪" in line or "J_proj" in line)]
    drawn = [line for line in stated if "| medium" not in line]
    assert len(drawn) == len(claims) == 24 and set(drawn) == claims
    # the ablation's other runs (50 tokens, 40 epochs), with their scale column
    assert sorted(line for line in stated if "| medium" in line) == sorted(ablation_claims[2:]) and len(ablation_claims[2:]) == 24
    # every scale of the ablation, three seeds each
    assert len(ablation[2:]) == 8 and all("| 0 1 2 |" in row for row in ablation[2:])
    for row in ablation[2:]:
        assert row in docs, row
