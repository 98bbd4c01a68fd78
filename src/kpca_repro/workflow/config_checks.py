"""The configuration check of ``workflow/rules/common.smk``, one call while the workflow is parsed:
the JSON schema, then what a schema cannot express and needs no torch, timm or transformers. Each
failure is a :class:`ConfigError` of one line: the key, what is wrong, what to do. Whether timm
knows a model and the capture supports its attention is checked by the job that loads the model.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Iterator
from pathlib import Path

from kpca_repro.inputs.model_info import MissingModelError, resolve_local_dir
from kpca_repro.inputs.resources import imagenet_sample_dir, timm_weights_path
from kpca_repro.training.summary import scale_tokens

__all__ = [
    "ConfigError",
    "schema_error_message",
    "checked_config",
    "check_config",
    "image_count_error",
    "run_model_scale",
    "resolve_scales",
    "image_source",
    "weights_path",
]


class ConfigError(ValueError):
    """A configuration value the pipeline cannot run with; the message names the key."""


def schema_error_message(config: dict, schema: dict, schema_name: str) -> str | None:
    """The JSON-schema violations of ``config``, one short line each (the shallowest first), or None if none."""
    import jsonschema

    errors = list(jsonschema.Draft202012Validator(schema).iter_errors(config))
    errors = [e for e in errors if e.validator != "required"] or errors
    if not errors:
        return None
    lines = dict.fromkeys(
        _schema_line(e) for e in sorted(errors, key=lambda e: (len(e.absolute_path), list(map(str, e.absolute_path))))
    )
    return (
        "\n".join(lines) + f". Fix it in your --configfile / --config; every key, type and range is in {schema_name}."
    )


def _schema_line(err) -> str:
    """One schema violation in words, naming the key."""
    where = ".".join(str(p) for p in err.absolute_path)
    if err.validator == "additionalProperties":
        allowed = list(err.schema.get("properties", {}))
        unknown = sorted(set(err.instance) - set(allowed))
        hints = [
            f"{where}.{key}".lstrip(".")
            + "".join(f" (did you mean {m!r}?)" for m in difflib.get_close_matches(key, allowed, n=1))
            for key in unknown
        ]
        what = f"unknown config key {', '.join(hints)}; allowed here: {', '.join(allowed)}"
    elif err.validator == "anyOf" and err.context and all(e.validator == "required" for e in err.context):
        # alternatives of required keys (a training scale: `base`, or every key)
        branches: dict = {}
        for e in err.context:
            branches.setdefault(e.schema_path[0], []).append(repr(e.message.split("'")[1]))
        what = f"config key {where}: set " + ", or ".join(
            f"{' and '.join(keys)}" if len(keys) < 4 else f"every key (missing: {', '.join(keys)})"
            for keys in branches.values()
        )
    elif err.validator == "oneOf" and err.context:
        # alternatives of one value ('auto' or a positive integer): name them, not the schema
        what = f"config key {where}: {err.instance!r} is not {' or '.join(_describe(b) for b in err.validator_value)}"
    else:
        what = f"config key {where or '(top level)'}: {err.message}"
    return what


def _describe(branch: dict) -> str:
    """A schema alternative in words: ``'auto'``, ``an integer >= 1``, ``one of 'a', 'b'``."""
    if "const" in branch:
        return repr(branch["const"])
    if "enum" in branch:
        return " or ".join(repr(x) for x in branch["enum"])
    kind = {"integer": "an integer", "number": "a number", "string": "a string", "boolean": "true or false"}.get(
        branch.get("type"), str(branch.get("type", "a value"))
    )
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
            raise ConfigError(
                f"config key training.scales.{name}.base: {base!r} is not a scale of training.scales "
                f"({', '.join(scales)})"
            )
        if base in chain:
            raise ConfigError(
                f"config key training.scales.{name}.base: the bases form a cycle ({' -> '.join((*chain, name, base))})"
            )
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


def _training_problems(config: dict) -> Iterator[str]:
    """Figure 1/4 runs and the token ablation name configured models and scales; the paper scale needs ImageNet."""
    training, figure1 = config["training"], config["figure1"]
    scales = resolve_scales(training["scales"])
    for i, run in enumerate(figure1["runs"]):
        model, scale = run_model_scale(run)
        if model not in training["models"] or scale not in training["scales"]:
            yield (
                f"config key figure1.runs[{i}]: {run!r} is not <model>_<scale> with a model of training.models "
                f"({', '.join(training['models'])}) and a scale of training.scales ({', '.join(training['scales'])})"
            )
            continue
        sc, root = scales[scale], scales[scale]["imagenet_root"]
        if sc["dataset"] == "imagenet" and (
            root is None or not all(os.path.isdir(os.path.join(root, s)) for s in ("train", "val"))
        ):
            yield (
                f"config key training.scales.{scale}.imagenet_root: {root} must hold train/ and val/ class "
                f"folders (ImageNet-1k) for run {run}"
            )
        try:
            scale_tokens(sc)
        except ValueError as exc:
            yield f"config key training.scales.{scale}.patch_size: {exc}"
    for key, known, where in (("models", training["models"], "training.models"), ("scales", scales, "training.scales")):
        for i, name in enumerate(config.get("token_ablation", {}).get(key, [])):
            if name not in known:
                yield f"config key token_ablation.{key}[{i}]: {name!r} is not in {where} ({', '.join(known)})"
    ref = figure1["reference_logs"]
    if figure1["use_reference"] and ref is not None and not os.path.isdir(ref):
        yield f"config key figure1.reference_logs: {ref} is not a directory (the authors' W&B CSV exports)"


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
    return (
        f"config key {keys}: {n} images requested, but {root} holds {available}; lower {keys} or set "
        "vision.imagenet_val_dir to a larger image set"
    )


def _checksum_problems(config: dict, checked: dict[str, str]) -> Iterator[str]:
    """Existing weights with an entry in ``checksums`` have that SHA-256 (``checked``: path -> digest,
    already hashed). The image counts are checked per scheduled sample (:func:`image_count_error`)."""
    from kpca_repro.inputs.resources import ChecksumMismatchError, check_checksum

    for model in dict.fromkeys([*config["vision"]["models"], config["figure3"]["model"]]):
        expected = config["checksums"].get(model)
        path = weights_path(config, model)
        if not expected or path in checked or not os.path.exists(path):
            continue
        try:
            checked[path] = check_checksum(path, expected)
        except ChecksumMismatchError as exc:
            yield f"config key checksums.{model}: {exc}"


def checked_config(config: dict, schema_path: str | os.PathLike, *, main_process: bool = True) -> None:
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
        message = schema_error_message(
            config, yaml.safe_load(Path(schema_path).read_text()), "workflow/schemas/config.schema.yaml"
        )
        if message is None:
            raise
        raise ConfigError(message) from None
    config["training"]["scales"] = resolve_scales(config["training"]["scales"])
    check_config(config, main_process=main_process)


def check_config(config: dict, *, main_process: bool = True, checksums_done: dict[str, str] | None = None) -> None:
    """Every check of the configuration a JSON schema cannot express and no model is needed for
    (module docstring); ``main_process`` False (a cluster job parsing the workflow): no weights hashed.

    Raises:
        ConfigError: every problem found, one line each.
    """
    if problems := list(
        dict.fromkeys(_problems(config, main_process, {} if checksums_done is None else checksums_done))
    ):
        raise ConfigError("\n".join(problems))


def _problems(config: dict, main_process: bool, checksums_done: dict[str, str]) -> Iterator[str]:
    vision, text, decoders = config["vision"], config["text"], config["decoders"]
    for key in [*vision["model_kwargs"], *config["checksums"]]:
        if (
            key not in vision["models"]
            and key not in text["models"]
            and key not in decoders["models"]
            and key != config["figure3"]["model"]
        ):
            yield (
                f"config keys vision.model_kwargs / checksums: {key!r} is not in vision.models, text.models, "
                "decoders.models or figure3.model"
            )
    if vision["models"] and vision["shards"] > vision["n_images"]:
        yield (
            f"config key vision.shards: {vision['shards']} shards for {vision['n_images']} images "
            "(vision.n_images); use at most one shard per image"
        )
    published = config["comparison"]["published_tables"]
    # "builtin" is kpca_repro.analysis.comparison.BUILTIN, the copy shipped in the package (not imported:
    # comparison imports pandas, and these checks run at every parse)
    if published is not None and published != "builtin" and not os.path.isdir(published):
        yield (
            f"config key comparison.published_tables: {published} is not a directory; point it at a directory of the "
            "paper's published tables as CSV, "
            "set it to builtin (the copy shipped with kpca_repro, the default) or to null (no comparison)"
        )
    if text["shards"] > text["n_rows"]:
        yield (
            f"config key text.shards: {text['shards']} shards for {text['n_rows']} rows (text.n_rows); use at "
            "most one shard per row"
        )
    for section in ("text", "decoders"):
        for model_id, spec in config[section]["local_models"].items():
            if model_id in config[section]["models"]:
                try:
                    resolve_local_dir(spec)
                except MissingModelError as exc:
                    yield f"config key {section}.local_models[{model_id}]: {exc}"
    for model_id in set(text["models"]) & set(decoders["models"]):
        yield (
            f"config keys text.models / decoders.models: {model_id!r} is in both; an encoder belongs in "
            "text.models, a decoder in decoders.models"
        )
    root = vision["imagenet_val_dir"]
    if root is not None and not os.path.isdir(root):
        yield f"config key vision.imagenet_val_dir: {root} is not a directory"
    elif root is not None and not any(e.is_dir() for e in os.scandir(root)):
        yield (
            f"config key vision.imagenet_val_dir: {root} has no class folders; expected <dir>/<wnid>/*.JPEG (the "
            "ImageNet validation set sorted into class folders)"
        )
    if main_process:
        yield from _checksum_problems(config, checksums_done)
    yield from _training_problems(config)
    if config.get("activations"):  # h5py loads with kpca_repro.activations: only for a configuration that has entries
        from kpca_repro.activations import check_user_config

        try:
            check_user_config(config)
        except ValueError as exc:
            yield str(exc)
    for i, model in enumerate(config["figure5"]["models"] or []):
        if model not in text["models"]:
            yield (
                f"config key figure5.models[{i}]: {model!r} is not in text.models (its extraction is configured there)"
            )
