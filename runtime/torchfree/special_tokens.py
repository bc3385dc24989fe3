"""A tokenizer's EOS and BOS as its Hugging Face ``tokenizer_config.json`` names them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime.torchfree.errors import Problem, SpecError

TOKENIZER_CONFIG = "tokenizer_config.json"


@dataclass(frozen=True)
class SpecialTokens:
    eos: int | None
    bos: int | None
    why: str  # where they came from (printed by prepare)


def special_tokens(tokenizer_path: Path, backend: Any, eos: str | None = None, *,
                   require_eos: bool = True) -> SpecialTokens:
    """EOS and BOS as ``tokenizer_config.json`` beside ``tokenizer_path`` names them (Hugging Face's keys:
    ``eos_token``, ``bos_token``, ``add_bos_token``); ``eos`` (a token's text) overrides the config's EOS.
    BOS is added only where the config asks (``add_bos_token: true``)."""
    from runtime.torchfree.spec.hf import read_config

    config_path = tokenizer_path.parent / TOKENIZER_CONFIG
    config = read_config(config_path) if config_path.is_file() else {}

    def token(key: str) -> str | None:
        value = config.get(key)
        if isinstance(value, dict):  # {"content": "</s>", ...}
            value = value.get("content")
        return value if isinstance(value, str) else None

    def id_of(text: str, where: str, field: str) -> int:
        i = backend.token_to_id(text)
        if i is None:
            raise SpecError([Problem(where, field, f"{text!r} is not a token of {tokenizer_path}")])
        return int(i)

    eos_text, eos_where, eos_field = (eos, "--eos", "") if eos is not None else (token("eos_token"), str(config_path),
                                                                               "eos_token")
    if eos_text is None and not require_eos:
        return SpecialTokens(None, None, f"no EOS token ({config_path} names none)")
    if eos_text is None:
        raise SpecError([Problem(str(tokenizer_path), "eos_token", f"no EOS token: {config_path} names none; give "
                                                                   "--eos TOKEN")])
    eos_id = id_of(eos_text, eos_where, eos_field)
    add_bos = config.get("add_bos_token") is True
    bos_text = token("bos_token")
    if add_bos and bos_text is None:
        raise SpecError([Problem(str(config_path), "bos_token", "add_bos_token is true but no bos_token is named")])
    bos_id = id_of(bos_text, str(config_path), "bos_token") if add_bos and bos_text is not None else None
    source = "--eos" if eos is not None else config_path.name
    why = f"EOS {eos_text!r} ({eos_id}) from {source}" + (f", BOS {bos_text!r} ({bos_id})" if bos_id is not None
                                                           else ", no BOS (add_bos_token is not true)")
    return SpecialTokens(eos_id, bos_id, why)
