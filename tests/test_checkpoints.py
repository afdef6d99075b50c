"""Hugging Face checkpoints: config parsing, refusals, loading, and greedy output equal to
transformers' ``generate(do_sample=False)`` for every architecture and option."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from common.model import (
    Model,
    ModelConfig,
    UnsupportedModel,
    generate_greedy,
    get_config,
    load_config,
    seeded_tensors,
    write_checkpoint,
)
from tests.checkpoint_helpers import KINDS, hf_checkpoint, hf_generate, hf_logits

pytest.importorskip("transformers")


def _prompt(n: int, seed: int, vocab: int = 384) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=gen).tolist()


@pytest.fixture(scope="module")
def loaded() -> dict[str, Model]:
    return {}


def _model(loaded: dict, kind: str) -> Model:
    if kind not in loaded:
        loaded[kind] = Model(load_config(hf_checkpoint(kind)))
    return loaded[kind]


# Prompts longer than every kind's special length: Mistral's window (8), dynamic RoPE's
# original context (24), llama3's original context (32).
PROMPTS = [(5, 1), (40, 2)]


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_reference_equals_transformers_generate(loaded: dict, kind: str) -> None:
    model = _model(loaded, kind)
    for n, seed in PROMPTS:
        p = _prompt(n, seed)
        assert generate_greedy(model, [p], 12)[0] == hf_generate(kind, p, 12), (kind, n)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_logits_equal_transformers_at_float64(loaded: dict, kind: str) -> None:
    """At float64 the only gaps are transformers' own float32 casts (RMSNorm normalises
    in float32 whatever the dtype), about 1e-6 of the logits' scale."""
    model = _model(loaded, kind)
    tokens = _prompt(40, 7)
    ours, theirs = model.forward_dense(tokens), hf_logits(kind, tokens)
    assert ours.dtype == torch.float64
    torch.testing.assert_close(ours, theirs, rtol=0, atol=2e-5)


def test_config_fields_of_each_kind() -> None:
    llama3 = load_config(hf_checkpoint("llama3-rope"))
    assert (llama3.rope_type, llama3.rope_factor, llama3.rope_original_max_position,
            llama3.rope_theta, llama3.max_position) == ("llama3", 8.0, 32, 500000.0, 512)
    dyn = load_config(hf_checkpoint("dynamic-rope"))
    assert (dyn.rope_type, dyn.rope_original_max_position, dyn.max_position) == \
        ("dynamic", 24, 96)
    qwen = load_config(hf_checkpoint("qwen2"))
    assert qwen.qkv_bias and not qwen.o_bias and qwen.num_kv_heads == 1
    biased = load_config(hf_checkpoint("llama-bias-headdim"))
    assert biased.qkv_bias and biased.o_bias and biased.head_dim == 24
    assert load_config(hf_checkpoint("mistral")).sliding_window == 8
    assert load_config(hf_checkpoint("tied")).tie_word_embeddings
    plain = load_config(hf_checkpoint("llama"))
    assert (plain.dtype, plain.num_draft_layers, plain.head_dim) == ("float64", 0, 16)
    assert load_config(hf_checkpoint("llama"), dtype="float32").dtype == "float32"
    assert (hf_checkpoint("sharded") / "model.safetensors.index.json").is_file()


def test_old_and_new_rope_forms_parse_alike(tmp_path) -> None:
    new = json.loads((hf_checkpoint("llama3-rope") / "config.json").read_text())
    old = {k: v for k, v in new.items() if k != "rope_parameters"}
    params = dict(new["rope_parameters"])
    old["rope_theta"] = params.pop("rope_theta")
    old["rope_scaling"] = {"type": params.pop("rope_type"), **params}
    (tmp_path / "config.json").write_text(json.dumps(old))
    a, b = load_config(tmp_path), load_config(hf_checkpoint("llama3-rope"))
    assert a.with_overrides(path="", name="") == b.with_overrides(path="", name="")


def _refusal(tmp_path, change: dict, drop: tuple[str, ...] = ()) -> str:
    raw = json.loads((hf_checkpoint("llama") / "config.json").read_text())
    raw = {k: v for k, v in raw.items() if k not in drop} | change
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(UnsupportedModel) as err:
        load_config(tmp_path)
    return str(err.value)


@pytest.mark.parametrize("change,words", [
    ({"architectures": ["GPT2LMHeadModel"]}, "'GPT2LMHeadModel' is not supported"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}},
     "rope_parameters.rope_type='yarn' is not supported"),
    ({"quantization_config": {"quant_method": "awq"}}, "quant_method='awq'"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"mlp_bias": True}, "mlp_bias=True"),
    ({"vocab_size": 0}, "vocab_size=0"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 0.5, "rope_theta": 1e4}},
     "factor=0.5"),
])
def test_refusals_name_field_and_value(tmp_path, change: dict, words: str) -> None:
    assert words in _refusal(tmp_path, change)


def test_missing_files_are_clear(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        load_config(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_config(tmp_path)
    shutil.copy(hf_checkpoint("llama") / "config.json", tmp_path / "config.json")
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="pickled PyTorch weights are not loaded"):
        Model(load_config(tmp_path))


def test_wrong_tensor_shapes_and_missing_tensors_are_named(tmp_path) -> None:
    src = hf_checkpoint("llama")
    raw = json.loads((src / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(raw | {"intermediate_size": 96}))
    shutil.copy(src / "model.safetensors", tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"mlp.down_proj.weight' has shape \(64, 112\)"):
        Model(load_config(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(raw | {"num_hidden_layers": 4}))
    with pytest.raises(ValueError, match=r"lacks tensors \['model.layers.3"):
        Model(load_config(tmp_path))


def test_sharded_equals_single_file_and_fingerprints_differ() -> None:
    sharded = Model(load_config(hf_checkpoint("sharded")))
    assert len(list(hf_checkpoint("sharded").glob("model-*-of-*.safetensors"))) > 1
    again = Model(load_config(hf_checkpoint("sharded")))
    assert sharded.fingerprint == again.fingerprint
    assert sharded.fingerprint != Model(load_config(hf_checkpoint("llama"))).fingerprint
    as_f32 = Model(load_config(hf_checkpoint("sharded"), dtype="float32"))
    assert as_f32.fingerprint != sharded.fingerprint  # the weights as computed with differ
    assert as_f32.lm_head.dtype == torch.float32


def test_builtin_model_written_as_checkpoint_loads_identically(tmp_path) -> None:
    """A built-in (seeded) model exported in the Hugging Face layout is the same model,
    and transformers reads it as a LlamaForCausalLM with the same greedy output."""
    import transformers

    cfg = get_config("tiny", dtype="float64", num_draft_layers=0)
    write_checkpoint(tmp_path, cfg, seeded_tensors(cfg), max_shard_bytes=1 << 20)
    seeded, loaded = Model(cfg), Model(load_config(tmp_path))
    assert seeded.fingerprint == loaded.fingerprint
    assert torch.equal(seeded.blocks[1].w_qkv, loaded.blocks[1].w_qkv)
    p = _prompt(20, 3, vocab=cfg.vocab_size)
    want = generate_greedy(seeded, [p], 10)[0]
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    hf.generation_config.eos_token_id = None
    ids = torch.tensor([p])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                      max_new_tokens=10, pad_token_id=0)
    assert out[0, 20:].tolist() == want


def test_model_config_round_trips_with_options() -> None:
    cfg = load_config(hf_checkpoint("llama3-rope"))
    assert ModelConfig(**cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="rope_type='yarn'; allowed"):
        cfg.with_overrides(rope_type="yarn")


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
def test_float32_checkpoint_equals_transformers_float32(kind: str) -> None:
    model = Model(load_config(hf_checkpoint(kind, "float32")))
    assert model.lm_head.dtype == torch.float32
    for n, seed in PROMPTS:
        p = _prompt(n, seed)
        assert generate_greedy(model, [p], 10)[0] == hf_generate(kind, p, 10, "float32")


def test_bfloat16_logits_within_stated_tolerance() -> None:
    """bf16 (8 bits of mantissa): pdkv's and transformers' logits of the same bf16
    checkpoint differ by kernel rounding only. Stated tolerance: 5% of the logits' spread
    (max |logit| over the vocabulary) at every position, and the argmax agrees at >= 90% of
    positions (ties within that tolerance may flip)."""
    model = Model(load_config(hf_checkpoint("llama", "bfloat16")))
    tokens = _prompt(40, 9)
    ours = model.forward_dense(tokens).float()
    theirs = hf_logits("llama", tokens, "bfloat16").float()
    spread = theirs.abs().amax(-1, keepdim=True)
    assert ((ours - theirs).abs() / spread).max() < 0.05
    agree = (ours.argmax(-1) == theirs.argmax(-1)).float().mean()
    assert agree >= 0.9, agree


def test_truncated_or_foreign_weight_files_are_refused(tmp_path) -> None:
    src = hf_checkpoint("llama")
    shutil.copy(src / "config.json", tmp_path / "config.json")
    data = (src / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[:len(data) - 100])
    with pytest.raises(ValueError, match="is truncated"):
        Model(load_config(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(ValueError, match="is not a safetensors file"):
        Model(load_config(tmp_path))


def test_pdkv_model_export_writes_the_builtin_with_its_tokenizer(tmp_path) -> None:
    import transformers

    from common.model import Tokenizer
    from deploy.cli import main

    assert main(["model", "export", "tiny", str(tmp_path / "tiny"), "--dtype", "float64"]) == 0
    cfg = load_config(tmp_path / "tiny")
    assert (cfg.architecture, cfg.num_draft_layers, cfg.dtype) == ("LlamaForCausalLM", 0,
                                                                  "float64")
    assert Model(cfg).fingerprint == Model(get_config("tiny", dtype="float64")).fingerprint
    tok = Tokenizer.from_dir(tmp_path / "tiny")
    assert tok.eos_token_ids == (2, 4) and tok.encode("hi") == Tokenizer.builtin(512).encode(
        "hi")
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path / "tiny")
    assert hf.encode("Größe 🙂") == tok.encode("Größe 🙂")
    assert main(["model", "export", "tiny", str(tmp_path / "d"), "--layers", "1"]) == 0
    assert load_config(tmp_path / "d").num_layers == 1
