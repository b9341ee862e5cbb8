"""Settings from a file: `polytrain train --config FILE`, TOML (the standard library's `tomllib`) or JSON.

The keys are the settings' names (`batch_size`, or `batch-size` as flags spell them), at the top level or in
tables named for their groups (`[optimisation]`, `[pipeline]`); values as in `fit()`. A run's `config.json`
is such a file: it also records what ran (versions, the resolved device, the plan), which is read past, and
its run folder, which is not reused, so `--config runs/X/config.json` repeats run X into a new folder.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import UserError
from .declare import GROUPS
from .names import as_key, foreign, nearest
from .settings import INPUTS
from .train import SETTINGS, TrainConfig

# What a run folder's config.json records beside the settings (run_dir.write_config and api.train_run).
RUN_RECORD = (
    "versions",
    "device_type",
    "custom_model",
    "custom_data",
    "loss",
    "metrics",
    "classes",
    "vocab",
    "kept_tokenizer",
    "skipped_files",
    "strategy_plan",
)


def _load(path: Path) -> dict:
    text = path.read_bytes()
    if path.suffix == ".toml":
        try:
            import tomllib
        except ModuleNotFoundError:  # Python < 3.11
            try:
                import tomli as tomllib
            except ModuleNotFoundError:
                raise UserError(
                    f"--config {path}: reading TOML needs Python 3.11 or 'pip install tomli'; or "
                    f"write the settings as JSON"
                ) from None
        try:
            return tomllib.loads(text.decode("utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
            raise UserError(f"--config {path} is not valid TOML: {error}") from None
    if path.suffix == ".json":
        try:
            return json.loads(text)
        except (ValueError, UnicodeDecodeError) as error:
            raise UserError(f"--config {path} is not valid JSON: {error}") from None
    raise UserError(f"--config {path}: give a .toml or .json file of settings (e.g. a run's config.json)")


def read_config_file(path) -> dict:
    """name -> value of every setting the file gives; anything else in it is one line naming key and file."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise UserError(f"--config {path}: no such file; give a TOML or JSON file of settings")
    raw = _load(path)
    if not isinstance(raw, dict):
        raise UserError(f"--config {path} holds no table of settings; write name = value pairs")
    record = "versions" in raw
    if record and (raw.get("custom_model") or raw.get("custom_data")):
        raise UserError(
            f"--config {path}: that run was trained from Python on a custom model or in-memory data; "
            f"repeat it from Python with polytrain.fit"
        )
    if record:
        raw = {key: value for key, value in raw.items() if key not in RUN_RECORD}
    known = (*SETTINGS, *INPUTS)
    values = {}
    for key, value in _flatten(raw, path):
        name = key.replace("-", "_")
        said = foreign(name, as_key) if name not in known else None
        if said:
            raise UserError(f"--config {path}: unknown setting {key!r}; {said}")
        if name not in known:
            close = nearest(name, known)
            raise UserError(
                f"--config {path}: unknown setting {key!r}; "
                + (
                    f"did you mean {close!r}?"
                    if close
                    else "no setting is near it; see polytrain train --help for the settings"
                )
            )
        meta = SETTINGS.get(name) or INPUTS[name]
        try:
            values[name] = meta.parse(value) if meta.parse is not None and isinstance(value, str) else value
        except ValueError as error:  # the words of the flag's parser: what form it takes
            raise UserError(f"--config {path}: {key}: {error}") from None
        values[name] = _typed(name, values[name], f"--config {path}: {key}")
    if record:
        values.pop("out", None)  # that run's folder: the repetition gets a new one
        if values.get("strategy") == "single":
            values["strategy"] = "auto"  # what it resolved to on one device; --devices N may change it
        if "momentum" in values and not _takes_momentum(values.get("optimizer")):
            del values["momentum"]  # the default beside a model's own optimizer (gpt: AdamW), never read
    return values


def _takes_momentum(optimizer) -> bool:
    from ..optim import OPTIMIZERS, _key, keywords

    cls = OPTIMIZERS.get(_key(optimizer)) if isinstance(optimizer, str) else None
    return cls is None or "momentum" in keywords(cls)


def _kind(name: str):
    """The declared type of a setting without Optional (bool, int, float, str, tuple), or None."""
    field = TrainConfig.__dataclass_fields__.get(name)
    text = str(field.type).replace("Optional[", "").rstrip("]") if field is not None else ""
    return {"bool": bool, "int": int, "float": float, "str": str, "tuple": tuple}.get(text)


def _typed(name: str, value, where: str):
    """A file's value of the type its flag would give: text for a number reads as the flag reads it, a list for
    a text setting is its comma-separated form (`split = [4, 7]`), a number for a text setting its text; any
    other type is one line (`compile = "no"` must not switch it on)."""
    kind = _kind(name)
    if value is None or kind is None:
        return value
    if kind in (int, float) and isinstance(value, str):
        try:
            return kind(value)
        except ValueError:
            pass
    elif kind is str and isinstance(value, (int, float, list)) and not isinstance(value, bool):
        if not isinstance(value, list) or all(
            isinstance(v, (str, int)) and not isinstance(v, bool) for v in value
        ):
            return ",".join(map(str, value)) if isinstance(value, list) else str(value)
    elif kind is float and isinstance(value, int) and not isinstance(value, bool):
        return value
    elif isinstance(value, (list, tuple) if kind is tuple else kind) and not (
        kind is int and isinstance(value, bool)
    ):
        return value
    wanted = {
        bool: "true or false",
        int: "a whole number",
        float: "a number",
        str: "text in quotes",
        tuple: "a list such as " + _example(name),
    }[kind]
    raise UserError(f"{where} takes {wanted}, got {json.dumps(value)}")


def _example(name: str) -> str:
    meta = SETTINGS[name]
    return "[" + ", ".join((meta.metavar or "A,B").split(",")) + "]"


def _takes_table(key: str) -> bool:
    """Whether the setting `key` names takes a table as its value (tensor_plan), rather than being a group."""
    field = TrainConfig.__dataclass_fields__.get(key.replace("-", "_"))
    return field is not None and "dict" in str(field.type)


def _flatten(raw: dict, path: Path):
    """(key, value) pairs, with the tables named for a group (`[optimisation]`) opened."""
    tables = {name.replace("-", "_") for name in GROUPS}
    for key, value in raw.items():
        if isinstance(value, dict) and _takes_table(key):  # a setting's own value (tensor_plan)
            yield key, value
        elif isinstance(value, dict) and key.replace("-", "_") in tables:
            for inner, inner_value in value.items():
                if isinstance(inner_value, dict) and not _takes_table(inner):
                    raise UserError(
                        f"--config {path}: [{key}.{inner}] nests too deep; settings sit at the top "
                        f"level or in one table per group"
                    )
                meta = SETTINGS.get(inner.replace("-", "_")) or INPUTS.get(inner.replace("-", "_"))
                if meta is not None and meta.group.replace("-", "_") != key.replace("-", "_"):
                    raise UserError(f"--config {path}: {inner} belongs in [{meta.group}], not [{key}]")
                yield inner, inner_value
        elif isinstance(value, dict):
            raise UserError(
                f"--config {path}: [{key}] is not a group of settings; the groups are {', '.join(GROUPS)}"
            )
        else:
            yield key, value
