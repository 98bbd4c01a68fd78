"""The configuration checks a JSON schema cannot express (kpca_repro.workflow.config_checks), called
directly, and every bad configuration through the calls the workflow makes before its first job
(the schema and config_checks while it parses; the image count and the missing-input block in its
onstart handler, kpca_repro.workflow.preflight.stop_message), without Snakemake;
tests/test_reliability.py and tests/test_first_hour.py run one of each kind through Snakemake,
which stops before any job with the message. The checks that need timm (a model id, its attention,
figure3.block) run in the jobs: tests/test_workflow.py."""

from __future__ import annotations

import copy
import hashlib
import re
from pathlib import Path

import pytest
import yaml

from kpca_repro.method.variant import VARIANTS
from kpca_repro.workflow.config_checks import ConfigError, check_config, image_count_error, image_source, resolve_scales, run_model_scale, schema_error_message, weights_path

REPO = Path(__file__).resolve().parents[1]
SCHEMA = yaml.safe_load((REPO / "workflow" / "schemas" / "config.schema.yaml").read_text())
BASE = yaml.safe_load((REPO / "config" / "config.yaml").read_text())


def _config(tmp_path, **overrides) -> dict:
    """config/config.yaml with one small vision model, no language model, resources in tmp_path."""
    cfg = copy.deepcopy(BASE)
    cfg.update(resources_dir=str(tmp_path), offline=True, checksums={})
    cfg["vision"].update(models=["vit_tiny_patch16_224"], model_kwargs={}, n_images=4, shards=1)
    cfg["text"].update(models=[], local_models={})
    cfg["figure3"].update(model="vit_tiny_patch16_224", block=11, n_images=1)
    cfg["spectra"].update(n_images=3)
    cfg["figure1"].update(runs=[], use_reference=False)
    cfg["comparison"]["published_tables"] = None
    for key, value in overrides.items():
        if isinstance(value, dict):
            cfg[key].update(value)
        else:
            cfg[key] = value
    assert schema_error_message(cfg, SCHEMA, "schema") is None
    return cfg


def test_the_shipped_configuration_satisfies_the_schema():
    assert schema_error_message(BASE, SCHEMA, "schema") is None


def test_the_variant_names_are_the_registrys_in_the_schema_and_the_wildcard_constraint():
    """config["variants"]' enum and default, and the rules' {variant} constraint, are the names of
    kpca_repro.method.variant.REGISTRY: the constraint is built from it (evaluated here with
    another registry), the schema's enum is checked against it."""
    variants = SCHEMA["properties"]["variants"]
    assert variants["items"]["enum"] == variants["default"] == list(VARIANTS)
    common = (REPO / "workflow" / "rules" / "common.smk").read_text()
    constraints = re.search(r"^wildcard_constraints:\n(.*?)^\S", common, re.M | re.S).group(1)
    expression = re.search(r"^\s+variant=(.*?),\s*(#.*)?$", constraints, re.M).group(1)
    for names in (VARIANTS, ("paper", "exact32")):
        pattern = eval(expression, {"VARIANTS": names})
        assert [n for n in (*names, "paper_", "corrected_") if re.fullmatch(pattern, n)] == list(names)


def test_schema_errors_name_the_key_and_the_closest_allowed_one():
    bad = copy.deepcopy(BASE)
    bad["vision"]["n_imagse"] = 3
    msg = schema_error_message(bad, SCHEMA, "config.schema.yaml")
    assert msg.startswith("unknown config key vision.n_imagse (did you mean 'n_images'?)") and "config.schema.yaml" in msg
    bad = copy.deepcopy(BASE)
    bad["seed"] = "zero"
    assert schema_error_message(bad, SCHEMA, "s").startswith("config key seed: 'zero' is not of type 'integer'")
    bad = copy.deepcopy(BASE)  # a prediction interval over heads needs two draws per head
    bad["uncertainty"]["sign_draws_optimal_text"] = 1
    assert schema_error_message(bad, SCHEMA, "s").startswith("config key uncertainty.sign_draws_optimal_text: 1 is less than")


SCALE_KEYS = SCHEMA["$defs"]["scale"]["anyOf"][1]["required"]


def test_scales_inherit_from_their_base_and_override_only_what_they_set():
    raw = BASE["training"]["scales"]
    scales = resolve_scales(raw)
    assert raw["small"]["base"] == "paper" and "base" in raw["medium-n17"]  # the shipped config uses inheritance
    for name, scale in scales.items():
        assert sorted(set(scale) - {"seeds"}) == sorted(SCALE_KEYS), name  # every key, and no `base`; `seeds` is optional
    # three seeds at the paper's 197 tokens, inherited from medium by the token ablation and the long run
    assert [scales[n].get("seeds") for n in ("small", "medium", "medium-n50", "medium-n17", "medium-n17-long")] == [None, [0, 1, 2], [0, 1, 2], [0, 1, 2], [0, 1, 2]]
    # each key comes from the nearest scale in the chain that sets it
    for key in SCALE_KEYS:
        expected = raw["small"][key] if key in raw["small"] else raw["paper"][key]
        assert scales["small"][key] == expected
    assert list(scales["small"]) == list(raw["paper"])  # the base's key order
    # medium differs from small only in its images and patches; the ablation scales only in patches
    assert {k for k in SCALE_KEYS if scales["medium"][k] != scales["small"][k]} == {"n_train", "patch_size"}
    for name in ("medium-n50", "medium-n17"):
        assert {k for k in SCALE_KEYS if scales[name][k] != scales["medium"][k]} == {"patch_size"}
    assert {k for k in SCALE_KEYS if scales["medium-n17-long"][k] != scales["medium-n17"][k]} == {"epochs"}
    # tokens = (img_size / patch_size)^2 + the class token: the paper's 197, and 50, 17
    tokens = {n: (scales[n]["img_size"] // scales[n]["patch_size"]) ** 2 + 1 for n in ("medium", "medium-n50", "medium-n17", "small")}
    assert tokens == {"medium": 197, "medium-n50": 50, "medium-n17": 17, "small": 17}
    assert raw["small"]["base"] == "paper"  # not modified
    assert resolve_scales(scales) == scales  # idempotent on full scales


def test_scale_bases_that_name_no_scale_or_form_a_cycle_are_errors():
    with pytest.raises(ConfigError, match=r"training.scales.b.base: 'nope' is not a scale"):
        resolve_scales({"a": {"epochs": 1}, "b": {"base": "nope"}})
    with pytest.raises(ConfigError, match=r"cycle \(a -> b -> a\)"):
        resolve_scales({"a": {"base": "b"}, "b": {"base": "a"}})


def test_the_schema_takes_override_scales_and_rejects_incomplete_or_misnamed_ones():
    cfg = copy.deepcopy(BASE)
    cfg["training"]["scales"]["mine"] = {"base": "medium", "epochs": 30}
    assert schema_error_message(cfg, SCHEMA, "s") is None
    cfg["training"]["scales"]["mine"] = {"epochs": 30}  # no base: every key is required
    assert schema_error_message(cfg, SCHEMA, "s").startswith("config key training.scales.mine: set 'base', or every key (missing: 'dataset', 'imagenet_root'")
    cfg["training"]["scales"]["mine"] = {"base": "medium", "epoch": 30}
    assert "training.scales.mine" in schema_error_message(cfg, SCHEMA, "s")
    del cfg["training"]["scales"]["mine"]
    cfg["training"]["scales"]["my_scale"] = {"base": "medium"}  # runs are <model>_<scale>: no '_'
    assert "my_scale" in schema_error_message(cfg, SCHEMA, "s")


def test_a_valid_small_configuration_passes(tmp_path):
    check_config(_config(tmp_path))
    check_config(_config(tmp_path, comparison={"published_tables": "builtin"}))  # the packaged tables, not a path
    assert image_source(_config(tmp_path)) == (f"{tmp_path}/images/imagenet-sample", "flat")
    assert weights_path(_config(tmp_path), "m") == f"{tmp_path}/weights/timm/m.safetensors"
    assert run_model_scale("vit_tiny_small") == ("vit_tiny", "small")


def test_a_run_whose_inherited_images_its_patches_do_not_divide_is_an_error(tmp_path):
    cfg = _config(tmp_path)
    cfg["training"]["scales"]["medium"]["patch_size"] = 5  # 28x28 images inherited from small
    cfg["figure1"]["runs"] = ["vit_tiny_medium"]
    with pytest.raises(ConfigError, match=r"^config key training.scales.medium.patch_size: patch_size 5 does not divide img_size 28$"):
        check_config(cfg)


@pytest.mark.parametrize(
    "overrides, needle",
    [
        ({"vision": {"shards": 5}}, "config key vision.shards: 5 shards for 4 images (vision.n_images)"),
        ({"vision": {"model_kwargs": {"deit_small_patch16_224": {}}}}, "'deit_small_patch16_224' is not in vision.models"),
        ({"figure1": {"runs": ["nonexistent_small"]}}, "config key figure1.runs[0]: 'nonexistent_small'"),
        ({"figure5": {"models": ["bert-base-uncased"]}}, "config key figure5.models[0]: 'bert-base-uncased' is not in text.models"),
        ({"comparison": {"published_tables": "/nonexistent/tables"}}, "config key comparison.published_tables: /nonexistent/tables is not a directory"),
        ({"vision": {"imagenet_val_dir": "/nonexistent/val"}}, "config key vision.imagenet_val_dir: /nonexistent/val is not a directory"),
        ({"token_ablation": {"scales": ["medium", "nope"]}}, "config key token_ablation.scales[1]: 'nope' is not in training.scales"),
        ({"token_ablation": {"models": ["vit_huge"]}}, "config key token_ablation.models[0]: 'vit_huge' is not in training.models"),
    ],
)
def test_each_problem_is_one_error_naming_its_key(tmp_path, overrides, needle):
    with pytest.raises(ConfigError) as err:
        check_config(_config(tmp_path, **overrides))
    assert needle in str(err.value)
    assert "\n" not in str(err.value)


def test_every_problem_comes_in_one_block(tmp_path):
    """Two configuration problems, or two schema violations: one message, a line each, nothing raised before."""
    cfg = _config(tmp_path, vision={"shards": 5}, figure5={"models": ["bert-base-uncased"]})
    with pytest.raises(ConfigError) as err:
        check_config(cfg)
    lines = str(err.value).splitlines()
    assert len(lines) == 2 and lines[0].startswith("config key vision.shards") and lines[1].startswith("config key figure5.models[0]")
    bad = copy.deepcopy(BASE)
    bad["seed"], bad["vision"]["n_imagse"] = "zero", 3
    lines = schema_error_message(bad, SCHEMA, "s").splitlines()
    assert len(lines) == 2 and lines[0].startswith("config key seed") and lines[1].startswith("unknown config key vision.n_imagse")


def test_the_configuration_check_imports_no_model_library(tmp_path):
    """What common.smk imports and the whole configuration check load none of torch, timm or transformers.
    (pandas, which the table registry that paths reads imports, Snakemake has loaded before it reads the Snakefile.)"""
    import os
    import subprocess
    import sys

    cfg_file = tmp_path / "cfg.yaml"
    cfg_file.write_text(yaml.safe_dump(_config(tmp_path)))
    code = (
        "import sys, yaml\n"
        "from kpca_repro.inputs import model_info, resources\n"
        "from kpca_repro.threads import gpu_resource\n"
        "from kpca_repro.training import summary\n"
        "from kpca_repro.workflow import code, config_checks, paths, preflight\n"
        f"config_checks.check_config(yaml.safe_load(open({str(cfg_file)!r})))\n"
        "gpu_resource('auto')\n"
        "heavy = sorted(m for m in ('torch', 'timm', 'transformers') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    # the reason pandas is allowed: Snakemake's command line has imported it before any Snakefile is read
    subprocess.run([sys.executable, "-c", "import sys, snakemake.cli\nassert 'pandas' in sys.modules"], check=True)


def test_image_counts_and_weights_checksums(tmp_path, photos_dir):
    """More images requested than the set holds, and weights whose SHA-256 differs."""
    cfg = _config(tmp_path, vision={"imagenet_val_dir": None, "n_images": 4})
    images = tmp_path / "images" / "imagenet-sample"
    images.mkdir(parents=True)
    for p in sorted(Path(photos_dir).iterdir())[:2]:
        (images / p.name).write_bytes(p.read_bytes())
    # counted per scheduled sample (the onstart handler, preflight.stop_message), not by check_config
    check_config(cfg)
    assert re.fullmatch(r"config key vision.n_images: 4 images requested, but .* holds 2; lower vision.n_images .*", image_count_error(cfg, 4))
    assert image_count_error(cfg, 2) is None
    cfg["spectra"]["n_images"] = 4  # two keys asking for the same sample are both named
    assert image_count_error(cfg, 4).startswith("config key vision.n_images / spectra.n_images: 4 images requested")
    for p in sorted(Path(photos_dir).iterdir())[2:]:
        (images / p.name).write_bytes(p.read_bytes())
    weights = Path(weights_path(cfg, "vit_tiny_patch16_224"))
    weights.parent.mkdir(parents=True)
    weights.write_bytes(b"not weights")
    cfg["checksums"] = {"vit_tiny_patch16_224": "0" * 64}
    with pytest.raises(ConfigError, match="config key checksums.vit_tiny_patch16_224"):
        check_config(cfg)
    done: dict[str, str] = {}
    cfg["checksums"] = {"vit_tiny_patch16_224": hashlib.sha256(b"not weights").hexdigest()}
    check_config(cfg, checksums_done=done)
    assert done == {str(weights): cfg["checksums"]["vit_tiny_patch16_224"]}


# --------------------------------------------------------------------------------------
# What stops the workflow before any job, called directly: the configurations that
# tests/test_workflow.py and tests/test_reliability.py ran through Snakemake (target
# results/table1.csv), each with the message the user reads. One case of each kind still
# runs through Snakemake: tests/test_reliability.py (the schema, config_checks, a sample
# larger than the image set) and tests/test_first_hour.py (the missing-input block).
# --------------------------------------------------------------------------------------

MINILM = "sentence-transformers/all-MiniLM-L6-v2"
TINY_WEIGHTS = "weights/timm/vit_tiny_patch16_224.safetensors"
BAD_CONFIGURATIONS = [
    # the schema (kpca_repro.workflow.config_checks.schema_error_message)
    pytest.param({"sed": 0}, "unknown config key sed (did you mean 'seed'?)", id="misspelt-top-level-key"),
    pytest.param({"vision": {"batch_sise": 3}}, "unknown config key vision.batch_sise (did you mean 'batch_size'?)", id="misspelt-nested-key"),
    pytest.param({"vision": {"n_imagse": 3}}, "n_imagse", id="misspelt-nested-key-2"),
    pytest.param({"vision": {"n_images": "3"}}, "config key vision.n_images: '3' is not of type 'integer'", id="wrong-type"),
    pytest.param({"seed": "zero"}, "seed", id="wrong-type-seed"),
    pytest.param({"vision": {"batch_size": "3"}}, "config key vision.batch_size: '3' is not an integer >= 1 or 'auto'", id="wrong-alternative"),
    pytest.param({"offline": "yes"}, "config key offline: 'yes' is not of type 'boolean'", id="wrong-type-bool"),
    pytest.param({"vision": {"n_images": 0}}, "n_images", id="no-images"),
    pytest.param({"spectra": {"n_images": 1}}, "config key spectra.n_images: 1 is less than the minimum of 2", id="too-few-spectra-images"),
    pytest.param({"figure5": {"sentences": []}}, "sentences", id="no-figure5-sentences"),
    pytest.param({"text": {"models": [MINILM], "n_rows": 0}}, "config key text.n_rows: 0 is less than the minimum of 1", id="text-rows-out-of-range"),
    # config_checks.check_config
    pytest.param({"checksums": {"vit_tiny_patch16_224": "0" * 64}}, "config key checksums.vit_tiny_patch16_224: ", id="checksum-mismatch"),
    pytest.param({"vision": {"imagenet_val_dir": "PHOTOS"}}, "class folders", id="imagenet-val-dir-without-class-folders"),
    pytest.param({"text": {"models": [MINILM], "n_rows": 3, "shards": 5}}, "config key text.shards: 5 shards for 3 rows", id="text-more-shards-than-rows"),
    pytest.param(
        {"text": {"models": [MINILM], "local_models": {MINILM: "/nonexistent/minilm"}}},
        "config key text.local_models[sentence-transformers/all-MiniLM-L6-v2]: ",
        id="text-local-model-missing",
    ),
    # the onstart handler: a scheduled sample larger than the image set (config_checks.image_count_error)
    pytest.param({"vision": {"n_images": 6}}, "config key vision.n_images: 6 images requested, but", id="more-images-than-the-set"),
    # the onstart handler: the missing-input block (kpca_repro.workflow.preflight, offline)
    pytest.param("NO_IMAGES", "missing ImageNet sample images: ", id="resources-without-images"),
    pytest.param({"resources_dir": "/nonexistent/resources"}, "/nonexistent/resources/weights/timm/", id="no-resources"),
]


def _table1_stop(cfg_file: Path) -> str | None:
    """What stops ``snakemake results/table1.csv --configfile cfg_file`` before its first job, in the
    order Snakemake meets it: the parse (conftest.parse_stop), then the Snakefile's onstart handler
    (preflight.stop_message) with the jobs Table 1 schedules: its sample, and a download job for each
    model's weights and for the image set that are missing (workflow/rules/resources.smk)."""
    from kpca_repro.workflow.preflight import stop_message

    from conftest import parse_stop, workflow_config

    config = workflow_config(cfg_file)
    if (message := parse_stop(config)) is not None:
        return message
    jobs = [("sample_images", {"n": str(config["vision"]["n_images"])})]
    jobs += [("download_timm_weights", {"model": m}) for m in config["vision"]["models"] if not Path(weights_path(config, m)).exists()]
    jobs += [("download_imagenet_sample", {})] if not Path(image_source(config)[0]).exists() else []
    return stop_message(config, REPO / "config", jobs)


@pytest.mark.parametrize("overrides, needle", BAD_CONFIGURATIONS)
def test_each_bad_configuration_stops_the_workflow_naming_its_key(overrides, needle, tmp_path, tiny_resources, photos_dir):
    """Each configuration stops Table 1's run before any job with a message naming the key or the
    file (tests/test_workflow.py's configuration: two tiny ViTs, 4 images in 2 shards, offline)."""
    from test_workflow import _write_config

    resources = tiny_resources
    if overrides == "NO_IMAGES":  # weights present, images absent, offline
        resources = tmp_path / "resources"
        (resources / "weights").mkdir(parents=True)
        (resources / "weights" / "timm").symlink_to(tiny_resources / "weights" / "timm")
        overrides = {}
    overrides = copy.deepcopy(overrides)
    overrides.setdefault("resources_dir", str(resources))
    if overrides.get("vision", {}).get("imagenet_val_dir") == "PHOTOS":  # a flat folder of images
        overrides["vision"]["imagenet_val_dir"] = str(photos_dir)
    message = _table1_stop(_write_config(tmp_path / "bad.yaml", **overrides))
    assert message is not None and needle in message, message
    if "checksums.vit_tiny" in needle:  # names the file, the digests and what to do
        assert str(tiny_resources / TINY_WEIGHTS) in message
        assert "Replace the file" in message and "update the checksum" in message
