"""Hugging Face ``config.json`` <-> ModelSpec, for the decoders the runtime's Llama is.

Read: the Llama family as ``transformers`` defines it (``model_type`` llama, mistral, qwen2, and the
mixtures of experts mixtral, qwen2_moe, qwen3_moe: runtime/torchfree/spec/hf_moe.py), in either of its spellings
of RoPE (``rope_theta`` + ``rope_scaling``, or ``rope_parameters``); and GPT-style decoders (gpt2, opt,
gpt_neox, gpt_neo: ``GPT_KEYS``), which the planner prices and ``hspmd train`` refuses. What the runtime's
module cannot compute is refused here, naming the field, so that nothing downstream prices or trains a
different model than the file describes. Write: the config a checkpoint
carries, the source config's keys kept (tokenizer ids, ``transformers_version``...), the shape keys
rewritten from the spec.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from runtime.torchfree.errors import FieldErrors, Problem, SpecError
from runtime.torchfree.spec.hf_fields import Fields
from runtime.torchfree.spec.hf_moe import hf_field, moe_config, moe_from_config, qkv_bias
from runtime.torchfree.spec.io import is_dir, read_json
from runtime.torchfree.spec.model import ModelSpec, RopeScaling

CONFIG_FILE = "config.json"
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM"}
# Mixture-of-experts model_types the runtime does not build (DeepSeek: MLA and sigmoid routing; the others
# their own blocks).
MOE_TYPES = ("deepseek_v2", "deepseek_v3", "dbrx", "olmoe", "jamba")
# transformers' defaults for the keys a config.json may leave out, per model_type.
DEFAULT_EPS = {"llama": 1e-6, "mistral": 1e-6, "qwen2": 1e-6, "mixtral": 1e-5, "qwen2_moe": 1e-6, "qwen3_moe": 1e-6}
REQUIRED = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "vocab_size",
            "max_position_embeddings")


def is_hf_config(path: Path) -> bool:
    """A ``.json`` file is a Hugging Face config; model YAML files are everything else."""
    return path.suffix == ".json"


def config_file(path: Path) -> Path:
    """``path`` itself, or the ``config.json`` of a model directory."""
    return path / CONFIG_FILE if is_dir(path) else path


def read_config(path: str | Path) -> dict[str, Any]:
    """The raw JSON object of a config file, read with the bounded strict reader (runtime/torchfree/spec/io.py);
    unreadable, malformed or non-object files become a SpecError."""
    p = Path(path)
    data = read_json(p)
    if not isinstance(data, dict):
        raise SpecError([Problem(str(p), "", f"expected a JSON object, got {type(data).__name__}")])
    return data


def _rope(f: Fields) -> tuple[float, RopeScaling | None]:
    """rope_theta and the scaling, from ``rope_parameters`` (transformers 5) or ``rope_theta`` +
    ``rope_scaling`` (earlier)."""
    params = f.data.get("rope_parameters")
    if params is not None:
        where = "rope_parameters"
        if not isinstance(params, dict):
            f.bad(where, f"expected an object, got {params!r}")
            return 10000.0, None
        theta = f.get_float("rope_theta", 10000.0, params, "rope_parameters.")
        scaling: Any = params
    else:
        where = "rope_scaling"
        theta = f.get_float("rope_theta", 10000.0)
        scaling = f.data.get("rope_scaling")
        if scaling is None:
            return theta, None
        if not isinstance(scaling, dict):
            f.bad(where, f"expected an object or null, got {scaling!r}")
            return theta, None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind != "llama3":
        f.bad(f"{where}.rope_type", f"{kind!r} is not supported (supported: default, llama3)")
        return theta, None
    values: dict[str, Any] = {}
    before = len(f.problems)
    for key in ("factor", "low_freq_factor", "high_freq_factor"):
        if scaling.get(key) is None:
            f.bad(f"{where}.{key}", "missing required field (rope_type llama3)")
        else:
            values[key] = f.get_float(key, 0.0, scaling, where + ".")
    # the specs' integer bound too: 10**400 was read, and overflowed RoPE's float arithmetic
    orig = f.get_int("original_max_position_embeddings", None, required=True, source=scaling, prefix=where + ".")
    if len(values) < 3 or orig is None or len(f.problems) > before:
        return theta, None  # a figure already refused: RopeScaling would refuse its stand-in 0 a second time
    try:
        return theta, RopeScaling(values["factor"], values["low_freq_factor"], values["high_freq_factor"], orig)
    except FieldErrors as err:
        for field, message in err.problems:
            f.bad(f"{where}.{field}", message)
        return theta, None


# Per GPT-style model_type: its config keys for (layers, hidden, ffn, heads, positions, norm eps), the ffn
# width when the key is absent or null (a multiple of hidden), and whether the embeddings are tied by default.
GPT_KEYS: dict[str, tuple[tuple[str, str, str, str, str, str], int, bool]] = {
    "gpt2": (("n_layer", "n_embd", "n_inner", "n_head", "n_positions", "layer_norm_epsilon"), 4, True),
    "opt": (("num_hidden_layers", "hidden_size", "ffn_dim", "num_attention_heads", "max_position_embeddings",
             "layer_norm_eps"), 0, True),
    "gpt_neox": (("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                  "max_position_embeddings", "layer_norm_eps"), 0, False),
    "gpt_neo": (("num_layers", "hidden_size", "intermediate_size", "num_heads", "max_position_embeddings",
                 "layer_norm_epsilon"), 4, True),
}


def _gpt_spec(f: Fields, model_type: str, name: str) -> ModelSpec:
    """A GPT-style decoder's ModelSpec (transformers' key names and defaults for ``model_type``); what
    would change its parameter layout beyond what the spec holds is refused, naming the field."""
    (layers, hidden, ffn, heads, positions, eps_key), ffn_mult, tied_default = GPT_KEYS[model_type]
    sizes = {k: f.get_int(k, required=True) for k in (layers, hidden, heads, positions, "vocab_size")}
    h = sizes[hidden]
    width = f.get_int(ffn, required=ffn_mult == 0)
    if width is None and h is not None and ffn_mult:
        width = ffn_mult * h
    if model_type == "opt":
        proj = f.get_int("word_embed_proj_dim", h)
        if proj != h:
            f.bad("word_embed_proj_dim", f"{proj} is not supported (only hidden_size {h}: no projections)")
        if not f.get_bool("do_layer_norm_before", True):
            f.bad("do_layer_norm_before", "false is not supported (only pre-LayerNorm decoders)")
        if not f.get_bool("enable_bias", True):
            f.bad("enable_bias", "false is not supported (OPT's projections carry biases)")
    if model_type == "gpt_neox" and not f.get_bool("attention_bias", True):
        f.bad("attention_bias", "false is not supported (GPT-NeoX's projections carry biases)")
    eps = f.get_float(eps_key, 1e-5)
    tied = f.get_bool("tie_word_embeddings", tied_default)
    if f.problems:
        raise SpecError(f.problems)
    keys = {"num_layers": layers, "hidden_size": hidden, "ffn_hidden_size": ffn, "num_heads": heads,
            "num_kv_heads": heads, "max_seq_len": positions, "norm_eps": eps_key}
    try:
        return ModelSpec(name=name, num_layers=sizes[layers], hidden_size=h, ffn_hidden_size=width,
                         num_heads=sizes[heads], num_kv_heads=sizes[heads], vocab_size=sizes["vocab_size"],
                         max_seq_len=sizes[positions], norm_eps=eps, tie_word_embeddings=tied,
                         architecture=model_type)  # type: ignore[arg-type]
    except FieldErrors as err:
        raise SpecError([Problem(f.file, keys.get(field, field), message) for field, message in err.problems]) \
            from None


def spec_from_config(data: dict[str, Any], file: str, name: str) -> ModelSpec:
    """The ModelSpec of a parsed config.json; every problem raised at once, each naming its field."""
    f = Fields(data, file)
    model_type = data.get("model_type")
    if not isinstance(model_type, (str, type(None))):   # a list or mapping would not even hash
        f.bad("model_type", f"must be a string such as 'llama', got {model_type!r}")
        raise SpecError(f.problems)
    if model_type in GPT_KEYS:
        return _gpt_spec(f, model_type, name)
    if model_type not in ARCHITECTURES:
        if model_type is None:
            f.bad("model_type", "missing required field")
        elif model_type in MOE_TYPES or any(k in data for k in ("num_local_experts", "num_experts")):
            f.bad("model_type", f"{model_type!r} is a mixture-of-experts model the runtime does not build; "
                                f"supported: {', '.join(ARCHITECTURES)}")
        else:
            f.bad("model_type", f"{model_type!r} is not supported (supported: "
                                f"{', '.join([*ARCHITECTURES, *GPT_KEYS])})")
        raise SpecError(f.problems)
    sizes = {k: f.get_int(k, required=True) for k in REQUIRED}
    heads = sizes["num_attention_heads"]
    kv_heads = f.get_int("num_key_value_heads", heads)
    head_dim = f.get_int("head_dim")
    act = data.get("hidden_act", "silu")
    if act != "silu":
        f.bad("hidden_act", f"{act!r} is not supported (the runtime's MLP is SwiGLU: silu)")
    if f.get_bool("mlp_bias", False):
        f.bad("mlp_bias", "true is not supported (the runtime's MLP has no biases)")
    if model_type in ("llama", "qwen3_moe") and f.get_bool("attention_bias", False):
        f.bad("attention_bias", "true is not supported (the runtime's o_proj has no bias)")
    tp = f.get_int("pretraining_tp", 1)
    if tp not in (1, None):
        f.bad("pretraining_tp", f"{tp} is not supported (only 1: the weights' own layout)")
    theta, scaling = _rope(f)
    # The window is in use when Mistral sets one, when Qwen2 switches it on, or (transformers 5) when any
    # layer is listed as sliding; the runtime then refuses to train (ModelSpec.train_problem).
    layer_types = data.get("layer_types")
    sliding_layers = isinstance(layer_types, list) and "sliding_attention" in layer_types
    window = None
    if model_type in ("mistral", "mixtral") or sliding_layers or \
            model_type in ("qwen2", "qwen2_moe", "qwen3_moe") and f.get_bool("use_sliding_window", False):
        window = f.get_int("sliding_window")
    moe = moe_from_config(f, model_type, sizes["intermediate_size"], sizes["num_hidden_layers"])
    eps = f.get_float("rms_norm_eps", DEFAULT_EPS[model_type])
    tied = f.get_bool("tie_word_embeddings", False)
    if f.problems:
        raise SpecError(f.problems)
    try:
        return ModelSpec(name=name, num_layers=sizes["num_hidden_layers"], hidden_size=sizes["hidden_size"],
                         ffn_hidden_size=sizes["intermediate_size"], num_heads=heads, num_kv_heads=kv_heads,
                         vocab_size=sizes["vocab_size"], max_seq_len=sizes["max_position_embeddings"],
                         rope_theta=theta, norm_eps=eps, family=model_type, head_dim=head_dim,
                         qkv_bias=qkv_bias(f, model_type), qk_norm=model_type == "qwen3_moe",
                         tie_word_embeddings=tied, rope_scaling=scaling,
                         sliding_window=window, moe=moe)
    except FieldErrors as err:
        raise SpecError([Problem(file, hf_field(model_type, field) or HF_NAMES.get(field, field), message)
                         for field, message in err.problems]) \
            from None


# ModelSpec field -> config.json key, for problems found by ModelSpec's own validation.
HF_NAMES = {"num_layers": "num_hidden_layers", "ffn_hidden_size": "intermediate_size",
            "num_heads": "num_attention_heads", "num_kv_heads": "num_key_value_heads",
            "max_seq_len": "max_position_embeddings", "norm_eps": "rms_norm_eps"}


def load_hf_model(path: str | Path) -> ModelSpec:
    """The ModelSpec of a model directory or its config.json; named after the directory."""
    file = config_file(Path(path))
    return spec_from_config(read_config(file), str(file), file.parent.resolve().name or "model")


def config_for(spec: ModelSpec, dtype: str, source: dict[str, Any] | None = None) -> dict[str, Any]:
    """The config.json of a checkpoint of ``spec`` with weights in ``dtype`` ("float32", "bfloat16").

    The source config's other keys are kept as they were; the shape is rewritten from the spec (they agree
    when the spec was read from it). RoPE is written in the source's spelling, ``rope_theta`` +
    ``rope_scaling`` without one (transformers reads both)."""
    out = dict(source or {})
    out.update({
        "architectures": [ARCHITECTURES[spec.family]], "model_type": spec.family,
        "hidden_size": spec.hidden_size, "intermediate_size": spec.ffn_hidden_size,
        "num_hidden_layers": spec.num_layers, "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads, "head_dim": spec.head_size, "vocab_size": spec.vocab_size,
        "max_position_embeddings": spec.max_seq_len, "rms_norm_eps": spec.norm_eps, "hidden_act": "silu",
        "tie_word_embeddings": spec.tie_word_embeddings, "torch_dtype": dtype,
    })
    if "dtype" in out:
        out["dtype"] = dtype
    if spec.family == "llama":
        out.setdefault("attention_bias", False)
        out.setdefault("mlp_bias", False)
    if spec.family in ("mistral", "mixtral"):
        out["sliding_window"] = spec.sliding_window
    if spec.moe is not None:
        out.update(moe_config(spec))
    if spec.family in ("qwen2", "qwen2_moe", "qwen3_moe"):
        out["use_sliding_window"] = spec.sliding_window is not None
        if spec.sliding_window is not None:
            out["sliding_window"] = spec.sliding_window
    scaling = None if spec.rope_scaling is None else {
        "rope_type": "llama3", "factor": spec.rope_scaling.factor,
        "low_freq_factor": spec.rope_scaling.low_freq_factor, "high_freq_factor": spec.rope_scaling.high_freq_factor,
        "original_max_position_embeddings": spec.rope_scaling.original_max_position_embeddings}
    if "rope_parameters" in out:
        out["rope_parameters"] = {"rope_theta": spec.rope_theta, **(scaling or {"rope_type": "default"})}
    else:
        out["rope_theta"] = spec.rope_theta
        out["rope_scaling"] = scaling
    return out
