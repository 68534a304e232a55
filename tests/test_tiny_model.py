"""`pdserve model tiny`: configs and tokenizers that vLLM loads and serves, plus the package layout.

The engine tests start real vLLM OpenAI servers (random weights, --load-format dummy),
one per model, together: a start is mostly one core's work and the machine has two.
"""

from __future__ import annotations

import ast
import importlib.metadata
import json
from pathlib import Path
from typing import Iterator

import jinja2
import pytest
from openai import OpenAI
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from pdserve.deploy import tiny_model
from pdserve.deploy.cli import main as pdserve_main
from procs import Proc, process_tree_rss_bytes, start_together, start_vllm_server

SERVED_ARCHS = ("deepseek_v3", "gemma3")


@pytest.fixture(scope="module")
def tiny_deepseek_v4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny-deepseek_v4")
    assert pdserve_main(["model", "tiny", "--arch", "deepseek_v4", "--out", str(out)]) == 0
    return out


@pytest.fixture(params=("deepseek_v3", "gemma3", "deepseek_v4"))
def model_dir(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue(f"tiny_{request.param}")


def load(model_dir: Path) -> tuple[dict, PreTrainedTokenizerFast]:
    return json.loads((model_dir / "config.json").read_text()), AutoTokenizer.from_pretrained(str(model_dir))


def test_vocab_is_exactly_vocab_size_and_every_id_decodes(model_dir: Path) -> None:
    config, tok = load(model_dir)
    assert len(tok) == config["vocab_size"] == 1024
    assert sorted(tok.get_vocab().values()) == list(range(config["vocab_size"]))
    tokens = tok.convert_ids_to_tokens(list(range(config["vocab_size"])))
    assert all(isinstance(t, str) and t for t in tokens)
    assert isinstance(tok.decode(list(range(config["vocab_size"]))), str)


def test_special_token_ids_match_config(model_dir: Path) -> None:
    config, tok = load(model_dir)
    assert tok.bos_token_id == config["bos_token_id"]
    assert tok.eos_token_id == config["eos_token_id"]
    assert tok.pad_token_id == config.get("pad_token_id")


@pytest.mark.parametrize(
    "text",
    ["Hello, world! The 2048 experts.", "  leading spaces\n\ttabs\r\n", "Grüße, 世界! 🚀 ∑x²", ""],
)
def test_encode_decode_round_trip(tiny_deepseek_v3: Path, text: str) -> None:
    _, tok = load(tiny_deepseek_v3)
    ids = tok.encode(text, add_special_tokens=False)
    assert all(0 <= i < len(tok) for i in ids)
    assert tok.decode(ids) == text


def test_common_words_are_single_tokens(tiny_gemma3: Path) -> None:
    _, tok = load(tiny_gemma3)
    assert len(tok.encode(" the", add_special_tokens=False)) == 1
    assert len(tok.encode("prefill", add_special_tokens=False)) < len("prefill")


def test_chat_template_renders_deepseek_style_turns(tiny_gemma3: Path) -> None:
    _, tok = load(tiny_gemma3)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Bye"},
    ]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    bos, eos, user, asst = tiny_model.BOS, tiny_model.EOS, tiny_model.USER, tiny_model.ASSISTANT
    assert text == f"{bos}Be brief.{user}Hi{asst}Hello{eos}{user}Bye{asst}"
    without_prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert without_prompt == text[: -len(asst)]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    assert ids[0] == tok.bos_token_id and ids[-1] == tok.convert_tokens_to_ids(asst)


def test_chat_template_rejects_unknown_role(tiny_gemma3: Path) -> None:
    _, tok = load(tiny_gemma3)
    with pytest.raises(jinja2.TemplateError, match="unsupported chat role: tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


def test_generation_is_deterministic(tiny_deepseek_v3: Path, tmp_path: Path) -> None:
    again = tiny_model.write_tiny_model("deepseek_v3", tmp_path / "again")
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (again / name).read_bytes() == (tiny_deepseek_v3 / name).read_bytes(), name


def test_cli_rejects_unknown_arch(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exc:
        pdserve_main(["model", "tiny", "--arch", "llama", "--out", str(tmp_path)])
    assert exc.value.code == 2
    assert "invalid choice: 'llama'" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


# Fields vLLM 0.32's DeepSeek-V4 model (vllm/models/deepseek_v4/) reads from the HF config.
DEEPSEEK_V4_FIELDS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "qk_rope_head_dim", "q_lora_rank", "o_lora_rank", "o_groups", "sliding_window",
    "compress_ratios", "compress_rope_theta", "index_n_heads", "index_head_dim", "index_topk",
    "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "moe_intermediate_size",
    "num_hash_layers", "norm_topk_prob", "routed_scaling_factor", "scoring_func", "topk_method",
    "swiglu_limit", "hidden_act", "hc_mult", "hc_sinkhorn_iters", "hc_eps", "rms_norm_eps",
    "rope_theta", "rope_parameters", "max_position_embeddings", "expert_dtype",
)


@pytest.mark.slow  # imports vLLM
def test_deepseek_v4_config_loads_through_vllm(tiny_deepseek_v4: Path) -> None:
    """The DeepSeek-V4 config cannot run here (no AMX), so check it the way vLLM resolves it."""
    from vllm.config import ModelConfig
    from vllm.transformers_utils.configs.deepseek_v4 import DeepseekV4Config

    model = ModelConfig(model=str(tiny_deepseek_v4), tokenizer=str(tiny_deepseek_v4), max_model_len=4096)
    hf = model.hf_config
    assert isinstance(hf, DeepseekV4Config)
    assert model.architecture == "DeepseekV4ForCausalLM"
    assert model.is_deepseek_mla and model.get_head_size() == 512
    assert model.quantization == "deepseek_v4_fp8"
    missing = [f for f in DEEPSEEK_V4_FIELDS if getattr(hf, f, None) is None]
    assert not missing, f"config lacks fields the DeepSeek-V4 model reads: {missing}"
    assert len(hf.compress_ratios) == hf.num_hidden_layers + hf.num_nextn_predict_layers
    # Window-only, 4x (indexer) and 128x layers: all of DeepSeek-V4-Flash's KV cache groups.
    assert {0, 4, 128} == set(hf.compress_ratios)
    assert hf.num_attention_heads % hf.o_groups == 0
    assert hf.bos_token_id == 0 and hf.eos_token_id == 1


def test_distribution_puts_only_pdserve_at_top_level() -> None:
    # Run from the checkout, its pdserve.egg-info shadows the installed dist-info: check every copy.
    dists = list(importlib.metadata.distributions(name="pdserve"))
    assert dists
    for dist in dists:
        assert (dist.read_text("top_level.txt") or "").split() == ["pdserve"]
    owners = importlib.metadata.packages_distributions()
    assert sorted(name for name, owner in owners.items() if "pdserve" in owner) == ["pdserve"]
    # Editable install: the import finder's MAPPING is what `import` actually resolves.
    finders = [
        f for dist in dists for f in dist.files or () if f.name.startswith("__editable__") and f.suffix == ".py"
    ]
    assert finders, "pdserve is expected to be installed editable (pip install -e .)"
    tree = ast.parse(Path(finders[0].locate()).read_text())
    mapping = next(
        ast.literal_eval(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == "MAPPING"
    )
    assert "pdserve.kvstore" in mapping and "pdserve.deploy" in mapping
    assert {name.split(".")[0] for name in mapping} == {"pdserve"}


@pytest.fixture(scope="module")
def servers(request: pytest.FixtureRequest) -> Iterator[dict[str, Proc]]:
    """A vLLM server for each model the session's test_vllm_serves_tiny_model items serve, started
    together; each test stops its own."""
    archs = [a for a in SERVED_ARCHS if any(getattr(item, "originalname", "") == "test_vllm_serves_tiny_model"
                                            and item.callspec.params["arch"] == a for item in request.session.items)]
    dirs = [request.getfixturevalue(f"tiny_{arch}") for arch in archs]
    procs = start_together([lambda d=d: start_vllm_server(d) for d in dirs])
    try:
        yield dict(zip(archs, procs))
    finally:
        for proc in procs:
            proc.stop()


@pytest.mark.engine
@pytest.mark.parametrize("arch", SERVED_ARCHS)
def test_vllm_serves_tiny_model(arch: str, servers: dict[str, Proc], request: pytest.FixtureRequest,
                                record_property) -> None:
    model_dir: Path = request.getfixturevalue(f"tiny_{arch}")
    _, tok = load(model_dir)
    with servers[arch] as server:
        record_property("engine_start_s", round(server.ready_after_s or 0.0, 1))
        record_property("engine_rss_gib", round(process_tree_rss_bytes(server.pid) / 2**30, 2))
        client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == [str(model_dir)]
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there!"}]
        reply = client.chat.completions.create(
            model=str(model_dir), messages=messages, max_tokens=8, temperature=0.0,
            extra_body={"ignore_eos": True},
        )
        assert isinstance(reply.choices[0].message.content, str) and reply.choices[0].message.content
        assert reply.usage.completion_tokens == 8
        # The server rendered our chat template: same prompt length as the tokenizer's own rendering.
        prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert reply.usage.prompt_tokens == len(tok.encode(prompt, add_special_tokens=False))
    assert not server.alive()
