"""Hooks, HDF5 activation files, image sampling and resources."""

from __future__ import annotations

import subprocess
import sys

import h5py
import numpy as np
import pytest
import torch

from kpca_repro.activations import ActivationFile, CorruptActivationFileError
from kpca_repro.capture import vision
from kpca_repro.capture.extraction import extract_vision
from kpca_repro.capture.module_capture import record_activations
from kpca_repro.capture.vision import attention_modules, load_timm_model
from kpca_repro.h5io import atomic_output
from kpca_repro.inputs import images, resources
from kpca_repro.method.records import KpcaJob, kpca_records
from kpca_tools.recorders import AttentionRecorder

from conftest import TINY_KWARGS


@pytest.mark.parametrize("model_id", sorted(TINY_KWARGS))
def test_hooks_recompose_the_attention_output(model_id, tiny_resources):
    """q, k, v, h from the hooks give back the block's attention output and the naive attention."""
    model = load_timm_model(model_id, tiny_resources / "weights" / "timm" / f"{model_id}.safetensors", TINY_KWARGS[model_id])
    attns = attention_modules(model)
    outputs = {}
    handles = [a.register_forward_hook(lambda m, i, o, layer=layer: outputs.__setitem__(layer, o)) for layer, a in enumerate(attns)]
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad(), AttentionRecorder(attns) as rec:
        model(x)
    for h in handles:
        h.remove()
    n_prefix = model.num_prefix_tokens
    for layer, attn in enumerate(attns):
        t = rec.captured[layer]
        b, heads, n, d = t["q"].shape
        assert (heads, d) == (attn.num_heads, attn.head_dim) and n == n_prefix + 16
        naive = torch.softmax(t["q"] @ t["k"].transpose(-1, -2) / d**0.5, dim=-1) @ t["v"]
        torch.testing.assert_close(t["h"], naive, atol=1e-5, rtol=1e-4)
        recombined = attn.proj(t["h"].permute(0, 2, 1, 3).reshape(b, n, heads * d))
        torch.testing.assert_close(recombined, outputs[layer], atol=1e-5, rtol=1e-4)


def test_extract_and_read_back(tiny_resources, photos_dir, tmp_path):
    model_id = "vit_tiny_patch16_224"
    weights = tiny_resources / "weights" / "timm" / f"{model_id}.safetensors"
    recs = images.list_images(photos_dir, "flat")
    samples = images.sample_images(recs, 3, seed=0)
    out = tmp_path / "act.h5"
    sha = resources.sha256_file(weights)
    extract_vision(model_id, weights, sha, samples, out, batch_size=2, device=torch.device("cpu"), model_kwargs=TINY_KWARGS[model_id], progress=False)
    with ActivationFile(out) as af:
        assert af.attrs["weights_sha256"] == sha and af.n_layers == 2
        assert af.attr_json("inputs") == [p.split("/")[-1] for p in samples["path"]]
        assert "torch" in af.attr_json("versions")
        t = af.read(1)
        assert t["k"].shape == (3, 3, 17, 64) and t["k"].dtype == np.float32
        assert list(af.dataset_index) == list(samples["dataset_index"])
    # the same images through the model directly give the stored tensors
    model = load_timm_model(model_id, weights, TINY_KWARGS[model_id])
    tf = images.paper_transform(32)
    x = torch.stack([tf(images.load_image(p)) for p in samples["path"]])
    with torch.no_grad(), AttentionRecorder(attention_modules(model)) as rec:
        model(x)
    np.testing.assert_allclose(rec.numpy_layer(1)["v"], t["v"], atol=1e-5)
    records, meta, _ = kpca_records(out, KpcaJob("paper", heads_per_chunk=4))
    assert len(records) == 3 * 2 * 3 and meta["n_images"] == 3
    assert set(records["layer"]) == {0, 1} and set(records["head"]) == {0, 1, 2}


def test_activation_files_are_deterministic(tiny_resources, photos_dir, tmp_path):
    model_id = "vit_tiny_patch16_224"
    weights = tiny_resources / "weights" / "timm" / f"{model_id}.safetensors"
    samples = images.sample_images(images.list_images(photos_dir, "flat"), 2, seed=0)
    paths = [tmp_path / "a.h5", tmp_path / "b.h5"]
    for p in paths:
        extract_vision(model_id, weights, "x", samples, p, batch_size=2, device=torch.device("cpu"), model_kwargs=TINY_KWARGS[model_id], progress=False)
    assert paths[0].read_bytes() == paths[1].read_bytes()


def _tiny_vit_inputs(tiny_resources, photos_dir, n):
    model_id = "vit_tiny_patch16_224"
    weights = tiny_resources / "weights" / "timm" / f"{model_id}.safetensors"
    samples = images.sample_images(images.list_images(photos_dir, "flat"), n, seed=0)
    tf = images.paper_transform(32)
    x = torch.stack([tf(images.load_image(p)) for p in samples["path"]])
    return model_id, weights, samples, x


def test_record_activations_with_the_timm_recorder_writes_the_extracted_tensors(tiny_resources, photos_dir, tmp_path):
    """A user's entry point (record_activations) given the pipeline's timm recorder stores, bit for
    bit, the q, k, v, h extract_vision stores for the same images in the same batches."""
    model_id, weights, samples, x = _tiny_vit_inputs(tiny_resources, photos_dir, 3)
    extract_vision(model_id, weights, "x", samples, tmp_path / "pipeline.h5", batch_size=2, device=torch.device("cpu"), model_kwargs=TINY_KWARGS[model_id], progress=False)
    model = load_timm_model(model_id, weights, TINY_KWARGS[model_id])
    rec = vision.CaptureRecorder(vision.capture_plan(model, model_id), model_id)
    record_activations(model, rec, [x[:2], x[2:]], tmp_path / "user.h5", model_id=model_id)
    with ActivationFile(tmp_path / "pipeline.h5") as a, ActivationFile(tmp_path / "user.h5") as b:
        assert a.n_layers == b.n_layers == 2
        for layer in range(2):
            pipeline, user = a.read(layer), b.read(layer)
            for t in "qkvh":
                np.testing.assert_array_equal(pipeline[t], user[t], err_msg=f"layer {layer} {t}")


def test_a_hook_that_does_not_fire_is_refused_alike_by_extract_vision_and_record_activations(tiny_resources, photos_dir, tmp_path, monkeypatch):
    """The pipeline's extraction and a user's record_activations run the same forward-and-capture
    loop: a recorder whose h hooks never fire is refused by both with one error type and message,
    and neither leaves a file."""
    monkeypatch.setattr(vision.CaptureRecorder, "_h_pre_hook", lambda self, layer: lambda _mod, _args: None)
    model_id, weights, samples, x = _tiny_vit_inputs(tiny_resources, photos_dir, 2)
    with pytest.raises(vision.UnsupportedArchitectureError) as pipeline:
        extract_vision(model_id, weights, "x", samples, tmp_path / "pipeline.h5", batch_size=2, device=torch.device("cpu"), model_kwargs=TINY_KWARGS[model_id], progress=False)
    model = load_timm_model(model_id, weights, TINY_KWARGS[model_id])
    rec = vision.CaptureRecorder(vision.capture_plan(model, model_id), model_id)
    with pytest.raises(ValueError) as user:
        record_activations(model, rec, [x], tmp_path / "user.h5", model_id=model_id)
    assert type(pipeline.value) is type(user.value) and str(pipeline.value) == str(user.value)
    assert "(0, 'h'), (1, 'h')" in str(user.value) and "did not fire" in str(user.value)
    assert not rec.handles and not list(tmp_path.iterdir())  # hooks removed, no file


def test_truncated_activation_file_is_reported_with_its_name(tmp_path):
    bad = tmp_path / "broken.h5"
    with h5py.File(bad, "w") as f:
        f.attrs["n_layers"] = 2
    with pytest.raises(CorruptActivationFileError, match="broken.h5"):
        ActivationFile(bad)
    bad.write_bytes(b"\x89HDF\r\n\x1a\n" + b"\0" * 100)
    with pytest.raises(CorruptActivationFileError, match="broken.h5"):
        ActivationFile(bad)


def test_atomic_output_leaves_nothing_on_failure(tmp_path):
    target = tmp_path / "out.csv"
    with pytest.raises(RuntimeError):
        with atomic_output(target) as tmp:
            tmp.write_text("half")
            raise RuntimeError("killed")
    assert not target.exists() and not list(tmp_path.iterdir())
    with atomic_output(target) as tmp:
        tmp.write_text("whole")
    assert target.read_text() == "whole"


def test_atomic_directory_keeps_the_old_folder_until_complete(tmp_path):
    from kpca_repro.h5io import atomic_directory

    target = tmp_path / "downloads"
    target.mkdir()
    (target / "old.txt").write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_directory(target) as tmp:
            (tmp / "half.txt").write_text("half")
            raise RuntimeError("network")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["downloads"] and (target / "old.txt").exists()
    with atomic_directory(target) as tmp:
        (tmp / "new.txt").write_text("new")
    assert sorted(p.name for p in target.iterdir()) == ["new.txt"] and len(list(tmp_path.iterdir())) == 1


def test_paper_sampling_of_the_1000_image_set():
    # docs/method.md Section 1: seed 0 on the 1000-image sample gives these k = 1 and k = 25 draws
    assert images.sample_indices(1000, 1, 0) == [864]
    assert images.sample_indices(1000, 25, 0)[:5] == [864, 394, 776, 911, 430]
    with pytest.raises(ValueError):
        images.sample_indices(10, 11, 0)


def test_flat_folder_order_equals_imagefolder_order(photos_dir, tmp_path):
    for f in sorted(photos_dir.iterdir()):
        (tmp_path / f.name[:9]).mkdir()
        (tmp_path / f.name[:9] / f.name).symlink_to(f)
    flat = [r.path.split("/")[-1] for r in images.list_images(photos_dir, "flat")]
    folder = [r.path.split("/")[-1] for r in images.list_images(tmp_path, "imagefolder")]
    assert flat == folder


def test_imagefolder_listing_equals_torchvisions_imagefolder(photos_dir, tmp_path):
    # the listing without torchvision (images._image_folder_samples) against ImageFolder itself, on a tree
    # with what ImageFolder treats specially: nested folders, upper-case and non-image extensions, hidden
    # files, linked class folders and files, files beside the class folders
    from torchvision.datasets import ImageFolder

    photos = sorted(photos_dir.iterdir())
    root = tmp_path / "val"
    for i, f in enumerate(photos):
        cls = root / f"n{i:08d}"
        (cls / "sub" / "deeper").mkdir(parents=True)
        (cls / f"b_{i}.JPEG").symlink_to(f)
        (cls / "sub" / f"a_{i}.jpg").symlink_to(f)
        (cls / "sub" / "deeper" / f"c_{i}.PnG").symlink_to(f)
        (cls / f".hidden_{i}.jpeg").symlink_to(f)
        (cls / "notes.txt").write_text("not an image")
        (cls / f"z_{i}.jpg.bak").symlink_to(f)
    linked = tmp_path / "elsewhere"
    (linked / "inner").mkdir(parents=True)
    (linked / "inner" / "x.webp").symlink_to(photos[0])
    (linked / "y.tiff").symlink_to(photos[1])
    (root / "n00000002a").symlink_to(linked, target_is_directory=True)
    (root / "n00000000" / "linked_sub").symlink_to(linked / "inner", target_is_directory=True)  # os.walk follows it
    (root / "README.jpg").symlink_to(photos[2])  # beside the class folders: no class, not listed
    expected = ImageFolder(str(root)).samples
    got = [(r.path, r.class_index) for r in images.list_images(root, "imagefolder")]
    assert got == expected and len(got) == 4 * len(photos) + 3
    assert [r.dataset_index for r in images.list_images(root, "imagefolder")] == list(range(len(got)))
    (root / "n99999999").mkdir()  # a class folder without an image: both refuse the tree
    with pytest.raises(FileNotFoundError):
        ImageFolder(str(root))
    with pytest.raises(FileNotFoundError, match="n99999999"):
        images.list_images(root, "imagefolder")


def test_the_sampling_jobs_import_no_torch(photos_dir, tmp_path):
    # the workflow's check before its first job lists the images in Snakemake's own process, and the
    # sampling jobs (sample_images, sample_text) need no model library
    for f in sorted(photos_dir.iterdir()):
        (tmp_path / f.name[:9]).mkdir()
        (tmp_path / f.name[:9] / f.name).symlink_to(f)
    (tmp_path / "rows.txt").write_text("\n".join(f"row {i} " + "long enough to be drawn " * 2 for i in range(8)))
    code = (
        "import sys; from kpca_repro.inputs import images, text; "
        f"n = len(images.list_images({str(tmp_path)!r}, 'imagefolder')); "
        f"m = len(text.sample_rows(text.read_text_rows({str(tmp_path / 'rows.txt')!r}), 3, 30, 0)); "
        "print(n, m, sorted(x for x in ('torch', 'torchvision', 'transformers') if x in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["5", "3", "[]"]


def test_imagefolder_without_class_folders_fails_clearly(photos_dir):
    with pytest.raises(FileNotFoundError, match="class sub-folders"):
        images.list_images(photos_dir, "imagefolder")


def test_unreadable_image_is_named(tmp_path):
    bad = tmp_path / "n0_bad.JPEG"
    bad.write_bytes(b"not an image")
    with pytest.raises(images.UnreadableImageError, match="n0_bad.JPEG"):
        images.load_image(bad)


def test_shards_partition_the_sample():
    parts = [images.shard_slice(10, 3, s) for s in range(3)]
    assert sum((list(range(10))[p] for p in parts), []) == list(range(10))


def test_checksum_mismatch_names_the_file(tmp_path):
    f = tmp_path / "w.safetensors"
    f.write_bytes(b"abc")
    assert resources.check_checksum(f, None) == resources.sha256_file(f)
    with pytest.raises(resources.ChecksumMismatchError, match="w.safetensors"):
        resources.check_checksum(f, "0" * 64)


@pytest.mark.parametrize("n_items,batch_size", [(7, 2), (7, 3), (100, 25), (5, 8), (13, 1)])
def test_shard_batches_are_the_whole_samples_batches(n_items, batch_size):
    """Every shard count runs each item in the same global batch, and keeps each item once."""
    from kpca_repro.inputs.images import shard_batches, shard_slice

    for n_shards in range(1, min(n_items, 5) + 1):
        kept = []
        for shard in range(n_shards):
            rows = shard_slice(n_items, n_shards, shard)
            pos = 0
            for run, keep, offset in shard_batches(n_items, n_shards, shard, batch_size):
                assert run.start % batch_size == 0 and run.stop == min(run.start + batch_size, n_items)
                assert offset == pos and keep.stop > keep.start
                got = list(range(run.start, run.stop))[keep]
                assert got == list(range(rows.start + offset, rows.start + offset + len(got)))
                kept += got
                pos += len(got)
            assert pos == rows.stop - rows.start
        assert kept == list(range(n_items))
    with pytest.raises(ValueError, match="batch_size"):
        shard_batches(n_items, 1, 0, 0)


def test_sharded_extraction_gives_the_unsharded_rows(tiny_resources, photos_dir, tmp_path):
    """Shard files hold exactly the unsharded file's rows, bit for bit, and their own inputs
    (5 images in batches of 3: shard 1 of 2 re-runs the batch that shard 0 ends in)."""
    model_id = "vit_tiny_patch16_224"
    weights = tiny_resources / "weights" / "timm" / f"{model_id}.safetensors"
    samples = images.sample_images(images.list_images(photos_dir, "flat"), 5, seed=0)
    kw = dict(batch_size=3, device=torch.device("cpu"), model_kwargs=TINY_KWARGS[model_id], progress=False)
    extract_vision(model_id, weights, "x", samples, tmp_path / "all.h5", **kw)
    parts = []
    for shard in range(2):
        extract_vision(model_id, weights, "x", samples, tmp_path / f"s{shard}.h5", shard=(shard, 2), **kw)
        with ActivationFile(tmp_path / f"s{shard}.h5") as af:
            rows = samples.iloc[images.shard_slice(len(samples), 2, shard)]
            assert af.attr_json("inputs") == [p.split("/")[-1] for p in rows["path"]]
            assert list(af.sample_rank) == list(rows["sample_rank"])
            parts.append(af.read(1))
    with ActivationFile(tmp_path / "all.h5") as af:
        whole = af.read(1)
    for t in "qkvh":
        np.testing.assert_array_equal(np.concatenate([p[t] for p in parts]), whole[t])


def test_prefetch_batches_keeps_order_raises_in_place_and_stops_cleanly():
    """Decoding ahead on a thread pool: batches in order and whole, an unreadable image raises
    when its batch is reached (the batches before it are delivered), and a consumer that stops
    early leaves no thread running."""
    import threading
    import time

    from kpca_repro.capture.extraction import prefetch_batches

    def load(p):
        time.sleep(0.002 * (p % 3))  # finish out of order
        return torch.full((2,), float(p))

    batches = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10]]
    for threads in (1, 3):
        got = [b[:, 0].tolist() for b in prefetch_batches(load, batches, threads)]
        assert got == [[1.0, 2.0, 3.0], [4.0, 5.0], [6.0], [7.0, 8.0, 9.0, 10.0]]
    assert list(prefetch_batches(load, [], 2)) == []

    def unreadable(p):
        if p == 6:
            raise images.UnreadableImageError("cannot read image 6.jpg")
        return load(p)

    seen = []
    with pytest.raises(images.UnreadableImageError, match="6.jpg"):
        for b in prefetch_batches(unreadable, batches, 2):
            seen.append(b.shape[0])
    assert seen == [3, 2]
    gen = prefetch_batches(load, batches, 2)
    next(gen)
    gen.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("decode")]
    with pytest.raises(ValueError, match="threads"):
        next(prefetch_batches(load, batches, 0))


def test_decoding_threads_do_not_change_the_activation_file(tiny_resources, photos_dir, tmp_path):
    """The file is byte-identical whether images are decoded in order on one thread or ahead
    on three, with the HDF5 writes in the background either way."""
    model_id = "vit_tiny_patch16_224"
    weights = tiny_resources / "weights" / "timm" / f"{model_id}.safetensors"
    samples = images.sample_images(images.list_images(photos_dir, "flat"), 5, seed=0)
    paths = {t: tmp_path / f"d{t}.h5" for t in (1, 3)}
    for t, p in paths.items():
        extract_vision(model_id, weights, "x", samples, p, batch_size=2, device=torch.device("cpu"), model_kwargs=TINY_KWARGS[model_id], progress=False, decode_threads=t)
    assert paths[1].read_bytes() == paths[3].read_bytes()
