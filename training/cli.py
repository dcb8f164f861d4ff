"""The command line, built from the configuration tree (training/config.py): one flag per field, of the same name.

    config, explicit = parse(argv)         # flags (and --config, --resume's saved config) -> Config

`--help` lists the main flags of each section; every other field is a flag of the same kind (`--log-every 1`,
`--min-lr 1e-5`), listed in docs/training.md. Precedence: the defaults, then `--config` (a recipe's name,
training/recipes.py, or a JSON file of sections, such as a run's config.json) or, with --resume, the run's own
config.json, then the flags given. A resumed run keeps its model: a flag that would change it is refused, naming the
flag and both values.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import typing
from dataclasses import fields
from pathlib import Path
from typing import Any, Iterable, NoReturn, Optional, Sequence

from model import PRESETS, ModelConfig, config_for
from model.config import MLPS
from training.config import SECTIONS, Config, ConfigError
from training.recipes import RECIPES, recipe_sections, recipes_help

CONFIG_FILE = "config.json"  # in a run's directory: its resolved configuration

MODEL_HELP = {
    "d_model": "width (default: the --size preset's)",
    "n_layers": "number of blocks (default: the preset's)",
    "n_heads": "attention heads (default: the preset's)",
    "d_ff": "MLP hidden size (default: the preset's)",
    "context_length": "tokens per training sequence (the RoPE tables' length)",
    "n_kv_heads": "key/value heads: grouped-query attention (default: as many as --n-heads)",
    "window": "sliding-window attention of this many keys in the local layers",
    "window_pattern": "local (L) and global (G) layers, repeated over the blocks, e.g. LLLG: three with --window, one "
                      "with full attention",
    "attn_softcap": "cap attention scores at c * tanh(s / c)",
    "rope_theta": "RoPE base",
    "qk_norm": "RMS-normalise each head's queries and keys before attention",
    "mlp": "the MLP: swiglu, or relu2 (w2(relu(w1 x)^2), two matrices)",
    "zero_init_residual": "start the attention output and MLP down projections at zero",
    "logit_softcap": "cap the LM head's logits at c * tanh(z / c)",
}
MODEL_MAIN = ("d_model", "n_layers", "n_heads", "context_length", "n_kv_heads", "window")
DERIVED = {("model", "vocab_size")}  # set from the data (--vocab-size, the data's vocabulary), not by a flag of its own
TITLES = {"model": "model (what it is)", "execution": "execution (how it runs)", "optim": "optimizer",
          "data": "data", "run": "run"}


class OneLineParser(argparse.ArgumentParser):
    """argparse with errors as one line (no usage dump), exit status 2."""

    def error(self, message: str) -> NoReturn:
        print(f"error: {message}", file=sys.stderr)
        raise SystemExit(2)


def _field_type(section: str, name: str) -> Any:
    hint = typing.get_type_hints(SECTIONS[section])[name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


def _meta(section: str, name: str) -> dict[str, Any]:
    if section == "model":
        return {"help": MODEL_HELP.get(name, ""), "main": name in MODEL_MAIN,
                "choices": list(MLPS) if name == "mlp" else None, "flag": None}
    return dict({f.name: f.metadata for f in fields(SECTIONS[section])}[name])


def add_field(group: argparse._ArgumentGroup, section: str, name: str, shown: Optional[bool] = None,
              help: Optional[str] = None, dest: Optional[str] = None) -> None:
    """The flag of one field, with its type, choices and help; dest "section.name" unless given (another script's
    parser then reads it as args.<dest>, None when not given)."""
    meta, kind = _meta(section, name), _field_type(section, name)
    flag = "--" + (meta["flag"] or name).replace("_", "-")
    shown = meta["main"] if shown is None else shown
    text = (help or meta["help"]) if shown else argparse.SUPPRESS
    dest = dest or f"{section}.{name}"
    if kind is bool:
        group.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction, help=text)
    else:
        group.add_argument(flag, dest=dest, type=kind, choices=meta["choices"], help=text,
                           metavar=None if meta["choices"] else name.split("_")[-1].upper())


def build_parser(prog: str, description: str) -> OneLineParser:
    """train.py's parser: every field of the tree, the main ones listed, grouped by section."""
    p = OneLineParser(prog=prog, description=description, argument_default=argparse.SUPPRESS,
                      formatter_class=argparse.RawDescriptionHelpFormatter,
                      epilog="Every other field of the configuration is a flag of the same kind (e.g. --log-every 1 "
                             "--min-lr 1e-5 --window-pattern LLLG); docs/training.md lists them all.\n\n"
                             f"Recipes (--config NAME; the flags given still win):\n{recipes_help()}")
    for section, cls in SECTIONS.items():
        group = p.add_argument_group(TITLES[section])
        if section == "model":
            group.add_argument("--size", choices=list(PRESETS), help="size preset (default small)")
        for f in fields(cls):
            if (section, f.name) not in DERIVED:
                add_field(group, section, f.name)
        if section == "run":
            group.add_argument("--config", metavar="RECIPE|FILE",
                               help="a recipe by name (listed below) or a JSON file of sections (a run's config.json, "
                                    "say) to start from, before the flags given")
    return p


def given_fields(namespace: argparse.Namespace) -> dict[tuple[str, str], Any]:
    """{(section, field): value} of the flags given on the command line."""
    return {tuple(k.split(".", 1)): v for k, v in vars(namespace).items() if "." in k}


def read_config(spec: str) -> dict[str, dict[str, Any]]:
    """--config's sections: a recipe's (training/recipes.py) when `spec` names one, else a JSON file's."""
    if spec in RECIPES:
        return check_sections(recipe_sections(spec), f"recipe {spec}")
    return read_config_file(Path(spec))


def read_config_file(path: Path) -> dict[str, dict[str, Any]]:
    """The sections of a JSON config file, checked against the tree: unknown names are an error naming the file."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"--config {path} does not exist (nor is it a recipe: {', '.join(RECIPES)})") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"--config {path} is not a JSON file: {e}") from None
    return check_sections(data, str(path))


def check_sections(data: Any, where: str) -> dict[str, dict[str, Any]]:
    """`data` as sections of the tree; an unknown section or field is an error naming `where` and the key."""
    if not isinstance(data, dict):
        raise ConfigError(f"--config {where} must hold an object of sections ({', '.join(SECTIONS)})")
    for section, values in data.items():
        if section not in SECTIONS or not isinstance(values, dict):
            raise ConfigError(f"--config {where}: {section!r} is not a section ({', '.join(SECTIONS)})")
        known = {f.name for f in fields(SECTIONS[section])}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"--config {where}: unknown field {section}.{unknown[0]}")
    return data


def apply(base: Config, values: dict[tuple[str, str], Any]) -> Config:
    """`base` with the given (section, field) values; the model is checked once, whole, by resolve()."""
    sections: dict[str, dict[str, Any]] = {}
    for (section, name), value in values.items():
        sections.setdefault(section, {})[name] = value
    model = sections.pop("model", {})
    config = base.replace(**sections)
    if model:
        config = dataclasses.replace(config, model=_unchecked_model({**config.model.to_dict(), **model}))
    return config


def _unchecked_model(values: dict[str, Any]) -> ModelConfig:
    """A ModelConfig without its __post_init__ check, so that resolve() reports the problem with flag names."""
    model = object.__new__(ModelConfig)
    for f in fields(ModelConfig):
        object.__setattr__(model, f.name, values.get(f.name, f.default))
    return model


def flatten(sections: dict[str, dict[str, Any]]) -> dict[tuple[str, str], Any]:
    return {(s, k): v for s, values in sections.items() for k, v in values.items()}


def saved_config(out: Path) -> Optional[dict[str, dict[str, Any]]]:
    """The config.json a run wrote in `out`, or None (a run of an earlier version, or no run)."""
    path = out / CONFIG_FILE
    if not path.is_file():
        return None
    try:
        return read_config_file(path)
    except ConfigError as e:
        raise ConfigError(str(e).replace("--config ", "the run's ")) from None


def check_resume_keeps_model(out: Path, saved: Config, asked: Config) -> None:
    """A resumed run keeps its model: refuse a flag that changes it, naming the flag and both values."""
    for f in fields(ModelConfig):
        then, now = getattr(saved.model, f.name), getattr(asked.model, f.name)
        if then != now and f.name != "vocab_size":
            raise ConfigError(f"--{f.name.replace('_', '-')} {now} differs from the run in {out}, which has {then}: a "
                              "resumed run keeps its model (drop the flag, or start a new run with another --out)")


def parse(argv: Optional[Sequence[str]], prog: str = "train.py", description: str = "") -> tuple[Config, frozenset]:
    """The Config the command line asks for, and the names of the fields it set (flags and --config)."""
    ns = build_parser(prog, description).parse_args(argv)
    given = given_fields(ns)
    size = getattr(ns, "size", None)
    if size is not None:
        preset = config_for(size)
        given = {**{("model", k): getattr(preset, k) for k in ("d_model", "d_ff", "n_layers", "n_heads")
                    if ("model", k) not in given}, **given}
    base, from_file = Config(), {}
    if getattr(ns, "config", None) is not None:
        from_file = flatten(read_config(ns.config))
    resume = given.get(("run", "resume"), from_file.get(("run", "resume"), False))
    if resume:
        out = Path(given.get(("run", "out"), from_file.get(("run", "out"), base.run.out)))
        saved = saved_config(out)
        if saved is not None:
            base = apply(base, flatten(saved))
            asked = apply(base, {**from_file, **given})
            check_resume_keeps_model(out, base, asked)
            # A profile belongs to the command that asks for it, not to the run's later resumptions.
            profile = {**from_file, **given}.get(("run", "profile"))
            return (asked.replace(run={"resume": True, "overwrite": False, "profile": profile}),
                    frozenset(k for _, k in given))
    config = apply(base, {**from_file, **given})
    return config, frozenset(k for _, k in [*from_file, *given])


def write_config(config: Config, out: Path) -> None:
    """The resolved config as `<out>/config.json` (atomically)."""
    from training.run.files import write_atomic

    text = json.dumps(config.to_dict(), indent=2) + "\n"
    write_atomic(out / CONFIG_FILE, lambda f: f.write(text.encode()))


def describe_sections(config: Config, names: Iterable[str] = ("model", "execution", "optim", "data", "run")) -> str:
    """The config as one line per section, for the console."""
    d = config.to_dict()
    return "\n".join(f"  {name}: " + " ".join(f"{k}={v}" for k, v in d[name].items()) for name in names)
