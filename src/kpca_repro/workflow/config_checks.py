"""Checks of the configuration that its JSON schema cannot express, run while the workflow is
parsed (``workflow/rules/common.smk``, after the schema). Each failure is a :class:`ConfigError`
of one line: the key, what is wrong, what to do. Passes of the checks that import timm, torch or
transformers are kept in ``cache_dir`` (:mod:`kpca_repro.check_cache`).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import typing
from pathlib import Path

from kpca_repro.check_cache import CheckCache, library_fingerprint, package_version, sha256_file
from kpca_repro.inputs.model_info import LOCAL_MODELS_KEY, MissingModelError, VisionModelCheck, model_source, resolve_local_dir
from kpca_repro.inputs.resources import imagenet_sample_dir, timm_weights_path
from kpca_repro.training.summary import scale_tokens
from kpca_repro.workflow.preflight import config_json

__all__ = ["ConfigError", "schema_error_message", "check_config", "check_vision_model", "run_model_scale", "resolve_scales", "image_source", "weights_path"]


class ConfigError(ValueError):
    """A configuration value the pipeline cannot run with; the message names the key."""


def schema_error_message(config: dict, schema: dict, schema_name: str) -> str | None:
    """One short line for the first JSON-schema violation of ``config``, or None if none."""
    import jsonschema

    errors = list(jsonschema.Draft202012Validator(schema).iter_errors(config))
    errors = [e for e in errors if e.validator != "required"] or errors
    if not errors:
        return None
    err = min(errors, key=lambda e: len(e.absolute_path))
    where = ".".join(str(p) for p in err.absolute_path)
    if err.validator == "additionalProperties":
        allowed = list(err.schema.get("properties", {}))
        unknown = sorted(set(err.instance) - set(allowed))
        hints = [f"{where}.{key}".lstrip(".") + "".join(f" (did you mean {m!r}?)" for m in difflib.get_close_matches(key, allowed, n=1)) for key in unknown]
        what = f"unknown config key {', '.join(hints)}; allowed here: {', '.join(allowed)}"
    elif err.validator == "anyOf" and err.context and all(e.validator == "required" for e in err.context):
        # alternatives of required keys (a training scale: `base`, or every key)
        branches: dict = {}
        for e in err.context:
            branches.setdefault(e.schema_path[0], []).append(repr(e.message.split("'")[1]))
        what = f"config key {where}: set " + ", or ".join(f"{' and '.join(keys)}" if len(keys) < 4 else f"every key (missing: {', '.join(keys)})" for keys in branches.values())
    elif err.validator == "oneOf" and err.context:
        # alternatives of one value ('auto' or a positive integer): name them, not the schema
        what = f"config key {where}: {err.instance!r} is not {' or '.join(_describe(b) for b in err.validator_value)}"
    else:
        what = f"config key {where or '(top level)'}: {err.message}"
    return f"{what}. Fix it in your --configfile / --config; every key, type and range is in {schema_name}."


def _describe(branch: dict) -> str:
    """A schema alternative in words: ``'auto'``, ``an integer >= 1``, ``one of 'a', 'b'``."""
    if "const" in branch:
        return repr(branch["const"])
    if "enum" in branch:
        return " or ".join(repr(x) for x in branch["enum"])
    kind = {"integer": "an integer", "number": "a number", "string": "a string", "boolean": "true or false"}.get(branch.get("type"), str(branch.get("type", "a value")))
    if "minimum" in branch:
        kind += f" >= {branch['minimum']}"
    return kind


def resolve_scales(scales: dict) -> dict:
    """Training scales with every key: each ``base`` replaced by the keys it inherits."""

    def resolve(name: str, chain: tuple) -> dict:
        own = dict(scales[name])
        base = own.pop("base", None)
        if base is None:
            return own
        if base not in scales:
            raise ConfigError(f"config key training.scales.{name}.base: {base!r} is not a scale of training.scales ({', '.join(scales)})")
        if base in chain:
            raise ConfigError(f"config key training.scales.{name}.base: the bases form a cycle ({' -> '.join((*chain, name, base))})")
        return {**resolve(base, (*chain, name)), **own}

    return {name: resolve(name, ()) for name in scales}


def image_source(config: dict) -> tuple[str, str]:
    """``(directory, layout)`` of the images sampled for the vision analyses."""
    root = config["vision"]["imagenet_val_dir"]
    return (root, "imagefolder") if root is not None else (str(imagenet_sample_dir(config["resources_dir"])), "flat")


def weights_path(config: dict, model: str) -> str:
    """Where a timm model's weights are read: ``<resources_dir>/weights/timm/<model>.safetensors``."""
    return str(timm_weights_path(config["resources_dir"], model))


def run_model_scale(run: str) -> tuple[str, str]:
    """``"<model>_<scale>"`` (a ``figure1.runs`` entry) -> ``(model, scale)``."""
    return run.rpartition("_")[::2]


def _is_timm_model(model: str, cache: CheckCache) -> bool:
    """``timm.is_model(model)``; a True answer is kept in ``cache`` (per timm version)."""
    key = {"check": "timm.is_model", "model": model, "timm": package_version("timm")}
    if cache.get(key) == {"is_model": True}:
        return True
    import timm

    if found := bool(timm.is_model(model)):
        cache.put(key, {"is_model": True})
    return found


def check_vision_model(config: dict, key: str, model: str, cache_dir: str | os.PathLike | None = None) -> VisionModelCheck:
    """Build ``model`` on the meta device and check that the capture supports it
    (:func:`kpca_repro.capture.vision.check_vision_model`; cached in ``cache_dir`` when given)."""
    kwargs = config["vision"]["model_kwargs"].get(model, {})
    cache = CheckCache(cache_dir)
    cache_key = {"check": "vision_model", "model": model, "model_kwargs": kwargs, "timm": package_version("timm"), "torch": package_version("torch"), "library": library_fingerprint()}
    fields = typing.get_type_hints(VisionModelCheck)  # a cached entry with other fields or types is not used
    if (hit := cache.get(cache_key)) is not None and set(hit) == set(fields) and all(isinstance(hit[k], t) and not isinstance(hit[k], bool) for k, t in fields.items()):
        return VisionModelCheck(**hit)
    from kpca_repro.capture.vision import ModelBuildError, UnsupportedArchitectureError
    from kpca_repro.capture.vision import check_vision_model as build

    try:
        result = build(model, kwargs)
    except (UnsupportedArchitectureError, ModelBuildError) as exc:
        raise ConfigError(f"config key {key}: {exc}") from None
    cache.put(cache_key, dataclasses.asdict(result))
    return result


def _check_text_models(config: dict, cache: CheckCache) -> None:
    """Every text.models entry has an attention the capture supports, read from its config.json
    alone (local directory or Hugging Face cache; no weights). A pass is kept in ``cache``,
    keyed by the id, the ``config.json`` content, the transformers version and the library."""
    text = config["text"]
    for i, model_id in enumerate(text["models"]):
        try:
            source = model_source(model_id, text["local_models"], config["offline"])
        except MissingModelError:
            continue  # reported by the extract_text input function when a target needs the model
        path = config_json(source)
        key = path and {"check": "text_model", "model": model_id, "config_json": sha256_file(path), "transformers": package_version("transformers"), "library": library_fingerprint()}
        if key and cache.get(key) is not None:
            continue
        from kpca_repro.capture.hf_capture import check_text_model
        from kpca_repro.capture.vision import UnsupportedArchitectureError

        try:
            family = check_text_model(model_id, source)
        except UnsupportedArchitectureError as exc:
            raise ConfigError(f"config key text.models[{i}]: {exc}") from None
        if key and family is not None:
            cache.put(key, {"family": family})


def _check_training_config(config: dict, cache: CheckCache) -> None:
    """Figure 1/4 runs and the token ablation name configured models and scales; the paper scale needs ImageNet."""
    training, figure1 = config["training"], config["figure1"]
    scales = resolve_scales(training["scales"])
    for i, run in enumerate(figure1["runs"]):
        model, scale = run_model_scale(run)
        if model not in training["models"] or scale not in training["scales"]:
            raise ConfigError(
                f"config key figure1.runs[{i}]: {run!r} is not <model>_<scale> with a model of training.models "
                f"({', '.join(training['models'])}) and a scale of training.scales ({', '.join(training['scales'])})"
            )
        sc, root = scales[scale], scales[scale]["imagenet_root"]
        if sc["dataset"] == "imagenet" and (root is None or not all(os.path.isdir(os.path.join(root, s)) for s in ("train", "val"))):
            raise ConfigError(f"config key training.scales.{scale}.imagenet_root: {root} must hold train/ and val/ class folders (ImageNet-1k) for run {run}")
        try:
            scale_tokens(sc)
        except ValueError as exc:
            raise ConfigError(f"config key training.scales.{scale}.patch_size: {exc}") from None
    for key, known, where in (("models", training["models"], "training.models"), ("scales", scales, "training.scales")):
        for i, name in enumerate(config.get("token_ablation", {}).get(key, [])):
            if name not in known:
                raise ConfigError(f"config key token_ablation.{key}[{i}]: {name!r} is not in {where} ({', '.join(known)})")
    for name, m in training["models"].items():
        if not _is_timm_model(m["timm_id"], cache):
            raise ConfigError(f"config key training.models.{name}.timm_id: {m['timm_id']!r} is not a timm model id")
    ref = figure1["reference_logs"]
    if figure1["use_reference"] and ref is not None and not os.path.isdir(ref):
        raise ConfigError(f"config key figure1.reference_logs: {ref} is not a directory (the authors' W&B CSV exports)")


#: The keys that ask ``rule sample_images`` for ``results/samples/vision_<n>.tsv``.
IMAGE_COUNT_KEYS = ("vision.n_images", "spectra.n_images", "figure3.n_images")


def image_count_error(config: dict, n: int) -> str | None:
    """The one-line error when a scheduled sample of ``n`` images exceeds the image set, else None.

    Called by the input function of ``rule sample_images``, so only the image counts of the
    requested targets are checked (Table 1 does not check ``spectra.n_images``); an image set that
    does not exist yet (downloaded by a rule) is not counted.

    Args:
        config: the merged configuration.
        n: the sample size, the ``{n}`` of ``results/samples/vision_{n}.tsv``.
    """
    from kpca_repro.inputs.images import list_images

    root, layout = image_source(config)
    if not os.path.isdir(root) or n <= (available := len(list_images(root, layout))):
        return None
    keys = " / ".join(k for k in IMAGE_COUNT_KEYS if config[k.split(".")[0]]["n_images"] == n) or "vision.n_images"
    return f"config key {keys}: {n} images requested, but {root} holds {available}; lower {keys} or set vision.imagenet_val_dir to a larger image set"


def _check_resources(config: dict, checked: dict[str, str]) -> None:
    """Existing weights with an entry in ``checksums`` have that SHA-256 (``checked``: path -> digest,
    already hashed). The image counts are checked per requested sample (:func:`image_count_error`)."""
    from kpca_repro.inputs.resources import ChecksumMismatchError, check_checksum

    for model in dict.fromkeys([*config["vision"]["models"], config["figure3"]["model"]]):
        expected = config["checksums"].get(model)
        path = weights_path(config, model)
        if not expected or path in checked or not os.path.exists(path):
            continue
        try:
            checked[path] = check_checksum(path, expected)
        except ChecksumMismatchError as exc:
            raise ConfigError(f"config key checksums.{model}: {exc}") from None


def checked_config(config: dict, schema_path: str | os.PathLike, *, main_process: bool = True, cache_dir: str | os.PathLike | None = None) -> None:
    """The workflow's configuration check, in the order workflow/rules/common.smk runs it while
    Snakemake parses: validate ``config`` against the JSON schema at ``schema_path`` (Snakemake's
    ``validate``, which fills the defaults in place), resolve ``training.scales``
    (:func:`resolve_scales`), then :func:`check_config`.

    Raises:
        ConfigError: the first failure, in one short message (a schema error as
            :func:`schema_error_message` words it).
        snakemake.exceptions.WorkflowError: a schema error that message cannot word.
    """
    import yaml
    from snakemake.exceptions import WorkflowError
    from snakemake.utils import validate

    try:
        validate(config, str(schema_path))
    except WorkflowError:
        message = schema_error_message(config, yaml.safe_load(Path(schema_path).read_text()), "workflow/schemas/config.schema.yaml")
        if message is None:
            raise
        raise ConfigError(message) from None
    config["training"]["scales"] = resolve_scales(config["training"]["scales"])
    check_config(config, main_process=main_process, cache_dir=cache_dir)


def check_config(config: dict, *, main_process: bool = True, checksums_done: dict[str, str] | None = None, cache_dir: str | os.PathLike | None = None) -> None:
    """Every check of the configuration a JSON schema cannot express (module docstring)."""
    cache = CheckCache(cache_dir)
    vision, text = config["vision"], config["text"]
    for i, model in enumerate(vision["models"]):
        if not _is_timm_model(model, cache):
            raise ConfigError(f"config key vision.models[{i}]: {model!r} is not a timm model id (see timm.list_models()); the paper's ids are listed in config/config.yaml")
    model, block = config["figure3"]["model"], config["figure3"]["block"]
    if not _is_timm_model(model, cache):
        raise ConfigError(f"config key figure3.model: {model!r} is not a timm model id")
    depth = check_vision_model(config, "figure3.model", model, cache_dir).depth
    if block >= depth:
        raise ConfigError(f"config key figure3.block: {block} is out of range for {model}, which has {depth} blocks (0 to {depth - 1})")
    if main_process:
        for i, model in enumerate(vision["models"]):
            check_vision_model(config, f"vision.models[{i}]", model, cache_dir)
    for key in [*vision["model_kwargs"], *config["checksums"]]:
        if key not in vision["models"] and key not in text["models"] and key != config["figure3"]["model"]:
            raise ConfigError(f"config keys vision.model_kwargs / checksums: {key!r} is not in vision.models, text.models or figure3.model")
    if vision["models"] and vision["shards"] > vision["n_images"]:
        raise ConfigError(f"config key vision.shards: {vision['shards']} shards for {vision['n_images']} images (vision.n_images); use at most one shard per image")
    published = config["comparison"]["published_tables"]
    # "builtin" is kpca_repro.analysis.comparison.BUILTIN, the copy shipped in the package (not imported:
    # comparison imports pandas, and these checks run at every parse)
    if published is not None and published != "builtin" and not os.path.isdir(published):
        raise ConfigError(
            f"config key comparison.published_tables: {published} is not a directory; point it at a directory of the paper's published tables as CSV, "
            "set it to builtin (the copy shipped with kpca_repro, the default) or to null (no comparison)"
        )
    if text["shards"] > text["n_rows"]:
        raise ConfigError(f"config key text.shards: {text['shards']} shards for {text['n_rows']} rows (text.n_rows); use at most one shard per row")
    for model_id, spec in text["local_models"].items():
        if model_id in text["models"]:
            try:
                resolve_local_dir(spec)
            except MissingModelError as exc:
                raise ConfigError(f"config key {LOCAL_MODELS_KEY}[{model_id}]: {exc}") from None
    if main_process:
        _check_text_models(config, cache)
    root = vision["imagenet_val_dir"]
    if root is not None:
        if not os.path.isdir(root):
            raise ConfigError(f"config key vision.imagenet_val_dir: {root} is not a directory")
        if not any(e.is_dir() for e in os.scandir(root)):
            raise ConfigError(f"config key vision.imagenet_val_dir: {root} has no class folders; expected <dir>/<wnid>/*.JPEG (the ImageNet validation set sorted into class folders)")
    if main_process:
        _check_resources(config, {} if checksums_done is None else checksums_done)
    _check_training_config(config, cache)
    for i, model in enumerate(config["figure5"]["models"] or []):
        if model not in text["models"]:
            raise ConfigError(f"config key figure5.models[{i}]: {model!r} is not in text.models (its extraction is configured there)")
