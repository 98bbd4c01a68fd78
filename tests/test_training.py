"""Figures 1 and 4: the training log (J_proj while a ViT trains), resumption, log readers, figures."""

from __future__ import annotations

import gzip

import numpy as np
import pandas as pd
import pytest
import timm
import torch
import yaml

from kpca_repro import kpca, training
from kpca_repro.config_checks import resolve_scales
from kpca_repro.figures import plot_figure1, plot_figure4
from kpca_repro.training_summary import ABLATION_COLUMNS, scale_setting, scale_tokens, token_ablation_markdown, token_ablation_table
from kpca_repro.vision import AttentionRecorder

from conftest import REPO, run_snakemake

TINY = dict(num_classes=10, img_size=8, patch_size=4, in_chans=1, depth=2, embed_dim=32)


def _tiny_model(num_heads=2, standardize_qk=True, seed=0, drop_path=0.0, depth=2):
    torch.manual_seed(seed)
    return training.build_model("vit_tiny_patch16_224", num_heads=num_heads, standardize_qk=standardize_qk, drop_path=drop_path, **{**TINY, "depth": depth})


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
        blk.attn = training.RecordingAttention.from_timm(blk.attn, standardize_qk=False)
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
    logged = training.reconstruction_metrics(model, x, train_mode=False)
    per_layer = []
    for layer in range(2):
        cap = {t: v.double() for t, v in rec.captured[layer].items()}
        q, k = kpca.standardize_tokens(cap["q"], eps=0.0), kpca.standardize_tokens(cap["k"], eps=0.0)
        d = q.shape[-1]
        np.testing.assert_allclose((q * q).sum(-1).numpy(), d - 1, rtol=1e-9)  # unbiased std, no epsilon
        # h of the model is softmax(q k^T / sqrt(d)) v on the standardized q, k
        torch.testing.assert_close(cap["h"], kpca.attention_output(q, k, cap["v"]), rtol=1e-4, atol=1e-5)
        phi = kpca.feature_norm_sq(q, k, log_domain=True)  # float64, log domain: an independent path
        h_sq = (cap["h"] ** 2).sum(-1)
        e = (phi - h_sq).abs()
        per_layer.append([e.mean(), h_sq.mean(), phi.mean(), (e / (h_sq + 1e-8)).mean(), (e / (phi + 1e-8)).mean()])
    direct = np.mean(np.array(per_layer, dtype=float), axis=0)
    got = [logged[m] for m in ("error", "h_norms_ave", "phiq_norms_ave", "rel_error_wrt_h", "rel_error_wrt_phiq")]
    np.testing.assert_allclose(got, direct, rtol=2e-5)
    assert logged["error"] >= abs(logged["h_norms_ave"] - logged["phiq_norms_ave"]) - 1e-6  # mean|a-b| >= |mean a - mean b|


def test_train_mode_forward_uses_drop_path_and_eval_mode_does_not():
    model = _tiny_model(drop_path=0.5, depth=3)  # block 0 has rate 0; block 1's drop-path changes block 2's input
    x = torch.randn(4, 1, 8, 8)
    torch.manual_seed(0)
    a = training.reconstruction_metrics(model, x, train_mode=True)
    torch.manual_seed(1)
    b = training.reconstruction_metrics(model, x, train_mode=True)
    assert a != b and model.training  # mode restored
    assert training.reconstruction_metrics(model, x, train_mode=False) == training.reconstruction_metrics(model, x, train_mode=False)


# --------------------------------------------------------------------------------------
# Training: a well-formed log, exact resumption
# --------------------------------------------------------------------------------------


def test_two_epochs_write_a_well_formed_log(tmp_path):
    train_set, val_set = _synthetic_sets()
    df = training.train_run(_tiny_model(), train_set, val_set, _scale(), tmp_path / "log.csv", tmp_path / "ck.pt", seed=0, device=torch.device("cpu"), fingerprint="f", progress=False)
    on_disk = pd.read_csv(tmp_path / "log.csv")
    assert list(on_disk.columns) == list(training.LOG_COLUMNS)
    assert list(on_disk["epoch"]) == [0, 1]
    assert np.isfinite(on_disk.to_numpy(float)).all()
    pd.testing.assert_frame_equal(on_disk, df, check_dtype=False, rtol=1e-8)
    assert ((on_disk["test_acc1"] >= 0) & (on_disk["test_acc5"] >= on_disk["test_acc1"]) & (on_disk["test_acc5"] <= 100)).all()
    for split in ("train", "test"):
        assert (on_disk[f"{split}_error"] >= (on_disk[f"{split}_h_norms_ave"] - on_disk[f"{split}_phiq_norms_ave"]).abs() - 1e-6).all()
        assert (on_disk[f"{split}_h_norms_ave"] > 0).all() and (on_disk[f"{split}_phiq_norms_ave"] > 0).all()
    state = torch.load(tmp_path / "ck.pt", weights_only=False)
    assert state["epoch"] == 2 and state["fixed"]["train"].shape == (8, 1, 8, 8) and state["fixed"]["test"].shape == (16, 1, 8, 8)
    # the fixed "train" batch is batch index 2 of the first epoch; "test" the first validation batch
    torch.testing.assert_close(state["fixed"]["test"], torch.stack([val_set[i][0] for i in range(16)]))


def test_an_interrupted_run_resumes_to_the_same_log(tmp_path):
    """Stop after epoch 1 (and leave a stray row behind), restart: the same bytes as one run."""
    train_set, val_set = _synthetic_sets()
    scale = _scale(epochs=3, mixup=0.8, cutmix=1.0, model_ema=True, model_ema_decay=0.9)  # timm's Mixup, SoftTargetCE, EMA
    kw = dict(seed=3, device=torch.device("cpu"), fingerprint="f", progress=False)
    training.train_run(_tiny_model(), train_set, val_set, scale, tmp_path / "full.csv", tmp_path / "full.pt", **kw)

    class Killed(Exception):
        pass

    def kill(epoch, row):
        if epoch == 0:
            raise Killed

    with pytest.raises(Killed):
        training.train_run(_tiny_model(), train_set, val_set, scale, tmp_path / "part.csv", tmp_path / "part.pt", on_epoch_end=kill, **kw)
    assert len(pd.read_csv(tmp_path / "part.csv")) == 1
    with open(tmp_path / "part.csv", "a") as f:  # a row written after the checkpoint, then killed
        f.write(open(tmp_path / "part.csv").read().splitlines()[-1] + "\n")
    training.train_run(_tiny_model(seed=99), train_set, val_set, scale, tmp_path / "part.csv", tmp_path / "part.pt", **kw)
    assert (tmp_path / "part.csv").read_bytes() == (tmp_path / "full.csv").read_bytes()


def test_a_checkpoint_of_another_configuration_is_not_resumed(tmp_path):
    train_set, val_set = _synthetic_sets()
    kw = dict(seed=0, device=torch.device("cpu"), progress=False)
    training.train_run(_tiny_model(), train_set, val_set, _scale(epochs=1), tmp_path / "a.csv", tmp_path / "ck.pt", fingerprint="old", **kw)
    training.train_run(_tiny_model(), train_set, val_set, _scale(epochs=1), tmp_path / "b.csv", tmp_path / "ck.pt", fingerprint="new", **kw)
    assert (tmp_path / "a.csv").read_bytes() == (tmp_path / "b.csv").read_bytes()  # trained afresh, not "already done"
    assert torch.load(tmp_path / "ck.pt", weights_only=False)["fingerprint"] == "new"


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
    train_set, val_set, num_classes, in_chans = training.build_datasets(scale, tmp_path)
    assert (len(train_set), len(val_set), num_classes, in_chans) == (20, 32, 10, 1)
    x, y = train_set[3]
    assert x.shape == (1, 28, 28) and y == arrays["train"][1][3]
    expected = (arrays["train"][0][3] / 255.0 - training.FASHION_MNIST_MEAN) / training.FASHION_MNIST_STD
    np.testing.assert_allclose(x[0].numpy(), expected, rtol=1e-5, atol=1e-5)
    assert not list((tmp_path / "datasets" / "fashion-mnist").glob("*ubyte")) and not (tmp_path / "datasets" / "fashion-mnist" / "FashionMNIST").exists()
    with gzip.open(tmp_path / "bad.gz", "wb") as f:
        f.write(bytes([0, 0, 8, 1]) + (10).to_bytes(4, "big") + b"\x00" * 3)
    with pytest.raises(ValueError, match="bad.gz"):
        training.read_idx(tmp_path / "bad.gz")


def test_missing_fashion_mnist_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="fashion-mnist/train-images-idx3-ubyte.gz"):
        training.build_datasets(_scale(), tmp_path)


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
    curves = training.read_wandb_logs(tmp_path)
    assert set(curves["metric"]) == set(training.RECON_METRICS) and set(curves["split"]) == {"train", "test"}
    assert set(curves["model"]) == {"vit_tiny"} and len(curves) == 10 * 12
    err = curves[(curves["metric"] == "error") & (curves["split"] == "train")].sort_values("epoch")
    assert list(err["epoch"]) == list(range(12))
    np.testing.assert_allclose(err["x"], (steps + 2) / 15)
    np.testing.assert_allclose(err["value"], np.linspace(10, 1, 12) + 0.02)
    assert err["x"].iloc[-1] - err["epoch"].iloc[-1] > 0.5  # the drift is kept on the "step" axis
    rows = training.read_wandb_logs(tmp_path, epoch_axis="row")
    assert (rows["x"] == rows["epoch"]).all()
    (tmp_path / "vit_tiny" / "junk.csv").write_text('"Step","a - b"\n1,2\n')
    with pytest.raises(ValueError, match="junk.csv"):
        training.read_wandb_logs(tmp_path)


def test_figures_from_a_log_and_wandb_exports(tmp_path):
    write_wandb(tmp_path / "ref")
    train_set, val_set = _synthetic_sets()
    training.train_run(_tiny_model(), train_set, val_set, _scale(), tmp_path / "log.csv", tmp_path / "ck.pt", seed=0, device=torch.device("cpu"), fingerprint="f", progress=False)
    curves = training.training_curves([(tmp_path / "log.csv", "deit_tiny", "ours")], tmp_path / "ref", reference_source="ref")
    plotted = plot_figure1(curves, tmp_path / "f1.pdf", tmp_path / "f1.png", {"ref": 3}, {"ours": scale_setting(_scale()), "ref": "ImageNet"})
    assert (tmp_path / "f1.pdf").read_bytes()[:4] == b"%PDF" and (tmp_path / "f1.png").stat().st_size > 10_000
    assert plotted[plotted["source"] == "ref"]["x"].min() >= 3 and plotted[plotted["source"] == "ours"]["x"].min() == 0
    assert set(plotted["metric"]) == {"error", "h_norms_ave", "phiq_norms_ave"}
    curves.loc[curves["metric"] == "rel_error_wrt_phiq", "value"] *= 1e6
    rel = plot_figure4(curves, tmp_path / "f4.pdf", tmp_path / "f4.png", {"ref": 3})
    bottom = rel[rel["panel"] == "rel_phi"]
    np.testing.assert_allclose(bottom["plotted"], bottom["value"])  # drawn as they are, on a log axis
    assert rel[(rel["panel"] == "rel_h") & (rel["source"] == "ref")]["x"].min() >= 3
    assert bottom[bottom["source"] == "ref"]["x"].min() < 3  # the lower panel keeps every epoch


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
    run = tmp_path / "results" / "training" / "deit_tiny_small"
    log = pd.read_csv(run / "log.csv")
    assert list(log["epoch"]) == [0, 1] and np.isfinite(log.to_numpy(float)).all()
    state = torch.load(run / "checkpoint.pt", weights_only=False)
    assert state["epoch"] == 2 and state["model"]["blocks.0.attn.qkv.weight"].shape == (3 * 48, 48)
    assert [blk.attn.num_heads for blk in training.build_model("deit_tiny_patch16_224", num_heads=6, standardize_qk=True, **{**TINY, "depth": 1, "embed_dim": 48}).blocks] == [6]
    fig1 = pd.read_csv(tmp_path / "results" / "figure1.csv")
    assert set(fig1["model"]) == {"vit_tiny", "deit_tiny"} and fig1["source"].nunique() == 2
    assert (tmp_path / "results" / "figure4.png").stat().st_size > 10_000
    assert (tmp_path / "benchmarks" / "train" / "deit_tiny_small.tsv").exists()
    # the log lost (Snakemake deletes the output of a killed job): the rerun resumes from the checkpoint
    before = (run / "log.csv").read_bytes()
    (run / "log.csv").unlink()
    run_snakemake(tmp_path, "results/training/deit_tiny_small/log.csv", "--configfile", str(cfg))
    assert "resuming" in (tmp_path / "logs" / "train" / "deit_tiny_small.log").read_text()
    assert (run / "log.csv").read_bytes() == before


@pytest.mark.integration
@pytest.mark.parametrize(
    "figure1, needle",
    [({"runs": ["vit_tiny_huge"]}, "figure1.runs[0]"), ({"reference_logs": "/nonexistent/logs"}, "figure1.reference_logs"), ({"epoch_axis": "steps"}, "epoch_axis")],
)
def test_bad_training_configuration_fails_before_any_job(figure1, needle, tmp_path):
    (tmp_path / "ref").mkdir()
    figure1.setdefault("reference_logs", str(tmp_path / "ref"))
    cfg = _training_config(tmp_path / "c.yaml", tmp_path, **figure1)
    proc = run_snakemake(tmp_path, "results/figure1.pdf", "--configfile", str(cfg), check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and needle in out, out[-3000:]
    assert not (tmp_path / "results").exists()


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
        log = pd.DataFrame(rng.uniform(0.1, 100, size=(5, len(training.LOG_COLUMNS))), columns=list(training.LOG_COLUMNS))
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
    (tmp_path / "empty.csv").write_text(",".join(training.LOG_COLUMNS) + "\n")
    with pytest.raises(ValueError, match="no epochs"):
        token_ablation_table([(tmp_path / "empty.csv", "m", "s", 5)])


@pytest.mark.integration
def test_token_ablation_end_to_end_with_inherited_scales_and_resumption(tmp_path):
    """Two scales written as overrides of `small` (patch 4: 5 tokens, patch 2: 17 tokens on 8x8
    images) train with the token count their patches give, the ablation table holds their logs'
    first and last epochs, and a lost log is rebuilt from the checkpoint."""
    res = tmp_path / "res"
    write_fashion_mnist(res / "datasets" / "fashion-mnist")
    cfg = yaml.safe_load(_training_config(tmp_path / "c.yaml", res, runs=[], use_reference=False).read_text())
    cfg["training"]["scales"].update({"t-n5": {"base": "small", "n_val": 8}, "t-n17": {"base": "t-n5", "patch_size": 2}})
    cfg["token_ablation"] = {"models": ["vit_tiny"], "scales": ["t-n17", "t-n5"]}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    run_snakemake(tmp_path, "results/token_ablation.csv", "--configfile", str(tmp_path / "c.yaml"))
    table = pd.read_csv(tmp_path / "results" / "token_ablation.csv")
    assert list(table["tokens"]) == [5, 5, 17, 17] and list(table["scale"]) == ["t-n5", "t-n5", "t-n17", "t-n17"]
    for scale, tokens in (("t-n5", 5), ("t-n17", 17)):
        run = tmp_path / "results" / "training" / f"vit_tiny_{scale}"
        state = torch.load(run / "checkpoint.pt", weights_only=False)
        assert state["model"]["pos_embed"].shape == (1, tokens, 48)  # the inherited 8x8 images in this scale's patches
        log = pd.read_csv(run / "log.csv")
        row = table[(table["scale"] == scale) & (table["split"] == "test")].iloc[0]
        np.testing.assert_allclose([row["j_proj_first"], row["j_proj_last"]], log["test_error"].iloc[[0, -1]], rtol=1e-5)
    assert "| ViT-Tiny | 17 |" in (tmp_path / "results" / "token_ablation.md").read_text()
    run = tmp_path / "results" / "training" / "vit_tiny_t-n17"
    before = (run / "log.csv").read_bytes()
    (run / "log.csv").unlink()
    run_snakemake(tmp_path, "results/training/vit_tiny_t-n17/log.csv", "--configfile", str(tmp_path / "c.yaml"))
    assert "resuming" in (tmp_path / "logs" / "train" / "vit_tiny_t-n17.log").read_text()
    assert (run / "log.csv").read_bytes() == before
