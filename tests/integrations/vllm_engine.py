"""Run one vLLM engine with kvtier over a set of prompts, in its own process.

    python vllm_engine.py SPEC.json RESULT.json

SPEC holds ``model``, ``prompts`` (token id lists), ``max_tokens``,
``extra_config`` (the connector's ``kv_connector_extra_config``; ``null`` for
no connector), ``block_size``, ``multiprocessing``, ``hf_overrides``,
``tensor_parallel_size``, ``pipeline_parallel_size``, ``kv_cache_dtype``, ``engine_id``,
``reset_prefix_cache``, ``reset_after`` (per prompt, overriding
``reset_prefix_cache``), ``shutdown_timeout_s`` (how long the engine may take
to stop before vLLM kills it; 120 s) and ``lora`` (``name`` and ``path`` of a LoRA adapter
every prompt uses); with ``started_file`` the engine writes that file once
it has started and then waits to be killed. RESULT receives the greedy
tokens, vLLM's cached-token count per prompt, the time to first token per
prompt when ``ttft`` is set, and the engine start time.

:func:`serve` runs the same SPEC through ``vllm serve`` (the OpenAI server,
on loopback, with an API key) instead, over HTTP.

Also builds the local model the tests (and, larger, the benchmark) use:

    python vllm_engine.py --make-model DIR [LAYERS HIDDEN]
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

VOCAB = 1024


def make_model(out: str | Path, *, layers: int = 2, hidden: int = 64) -> Path:
    """A random Llama (seeded) with an offline word-level tokenizer; no download."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,  # vLLM's CPU attention supports head sizes 32, 64, 80, ...
        max_position_embeddings=8192,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    # transformers types ``to`` as a decorator; a dtype is what it takes at run time.
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(out, safe_serialization=True)  # type: ignore[arg-type]
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    vocab.update({f"w{i}": i for i in range(4, VOCAB)})
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
    ).save_pretrained(out)
    return out


def make_adapter(out: str | Path, *, seed: int, rank: int = 8, layers: int = 2) -> Path:
    """A random LoRA adapter (PEFT's format) on the k and v projections of
    :func:`make_model`'s model, strong enough to change greedy outputs."""
    import torch
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(layers):
        for module in ("k_proj", "v_proj"):
            name = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(rank, 64, generator=generator)
            tensors[f"{name}.lora_B.weight"] = torch.randn(64, rank, generator=generator)
    save_file(tensors, out / "adapter_model.safetensors", metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": ["k_proj", "v_proj"],
        "fan_in_fan_out": False,
        "modules_to_save": None,
    }
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


def run(spec: dict[str, Any]) -> dict[str, Any]:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if spec.get("multiprocessing") else "0"
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    transfer = None
    if spec.get("extra_config") is not None:
        transfer = KVTransferConfig(
            kv_connector="KVTierConnector",
            kv_connector_module_path="kvtier.integrations.vllm",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config=spec["extra_config"],
            engine_id=spec.get("engine_id"),
        )
    started = time.perf_counter()
    llm = LLM(
        model=spec["model"],
        kv_transfer_config=transfer,
        enforce_eager=True,
        max_model_len=spec.get("max_model_len", 1024),
        block_size=spec.get("block_size", 32),
        dtype="float32",
        seed=0,
        max_num_seqs=4,
        enable_prefix_caching=spec.get("prefix_caching", True),
        kv_cache_dtype=spec.get("kv_cache_dtype", "auto"),
        hf_overrides=spec.get("hf_overrides"),
        tensor_parallel_size=spec.get("tensor_parallel_size", 1),
        pipeline_parallel_size=spec.get("pipeline_parallel_size", 1),
        **({"enable_lora": True, "max_lora_rank": 8, "max_loras": 1} if spec.get("lora") else {}),
    )
    start_s = time.perf_counter() - started
    if spec.get("started_file"):
        Path(spec["started_file"]).write_text(str(os.getpid()))
        while True:  # until killed
            time.sleep(60)
    params = SamplingParams(temperature=0.0, max_tokens=spec.get("max_tokens", 8), ignore_eos=True)
    lora = None
    if spec.get("lora"):
        from vllm.lora.request import LoRARequest

        lora = LoRARequest(spec["lora"]["name"], 1, spec["lora"]["path"])
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in spec["prompts"]]
    result: dict[str, Any] = {"engine_start_s": start_s, "tokens": [], "cached": [], "ttft_s": []}
    if spec.get("ttft"):
        # One prompt at a time, one output token: the call's duration is the
        # time to first token. vLLM's own prefix cache (not kvtier's) is
        # emptied after each prompt (unless ``reset_prefix_cache`` is false,
        # or ``reset_after`` says otherwise for that prompt), so a prefix can
        # only come back through kvtier.
        first_token = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        default_reset = spec.get("reset_prefix_cache", True)
        resets = spec.get("reset_after") or [default_reset] * len(prompts)
        for prompt, reset in zip(prompts, resets, strict=True):
            began = time.perf_counter()
            (output,) = llm.generate([prompt], first_token, use_tqdm=False)
            result["ttft_s"].append(time.perf_counter() - began)
            result["tokens"].append(list(output.outputs[0].token_ids))
            result["cached"].append(output.num_cached_tokens or 0)
            if reset:
                llm.reset_prefix_cache()
    else:
        for output in llm.generate(prompts, params, use_tqdm=False, lora_request=lora):
            result["tokens"].append(list(output.outputs[0].token_ids))
            result["cached"].append(output.num_cached_tokens or 0)
    result["generate_s"] = time.perf_counter() - started - start_s
    # vLLM kills an engine process that takes longer than the timeout to stop
    # (5 s by default); give kvtier's drain of pending writes room on a busy machine.
    llm.llm_engine.engine_core.shutdown(timeout=spec.get("shutdown_timeout_s", 120))
    del llm
    result["total_s"] = time.perf_counter() - started
    return result


def serve(spec: dict[str, Any], log: Path) -> dict[str, Any]:
    """Run ``spec`` through a ``vllm serve`` process: same result as :func:`run`.

    The server listens on 127.0.0.1 (a free port) behind a random API key and
    gets the prompts one at a time on ``/v1/completions`` as token ids. It is
    stopped with SIGTERM, given ``--shutdown-timeout`` to let kvtier drain and
    write its stats file, and its process group is killed after, also when
    this raises or is interrupted.
    """
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    key = secrets.token_urlsafe(16)
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", spec["model"], "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--enforce-eager", "--seed", "0", "--max-num-seqs", "4",
        "--block-size", str(spec.get("block_size", 32)),
        "--max-model-len", str(spec.get("max_model_len", 1024)),
        "--enable-prefix-caching" if spec.get("prefix_caching", True)
        else "--no-enable-prefix-caching",
        "--enable-prompt-tokens-details", "--shutdown-timeout", "120",
    ]  # fmt: skip
    if spec.get("extra_config") is not None:
        transfer = {
            "kv_connector": "KVTierConnector",
            "kv_connector_module_path": "kvtier.integrations.vllm",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": spec["extra_config"],
        }
        command += ["--kv-transfer-config", json.dumps(transfer)]
    # The key goes through the environment, not the command line others can read.
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_API_KEY": key}
    started = time.perf_counter()
    with log.open("w") as out:
        # A session of its own: Ctrl-C here does not reach the server
        # mid-shutdown, and its engine processes can be killed as a group.
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    try:
        wait_healthy(process, port, log)
        start_s = time.perf_counter() - started
        result: dict[str, Any] = {"engine_start_s": start_s, "tokens": [], "cached": []}
        for prompt in spec["prompts"]:
            body = {
                "model": spec["model"],
                "prompt": prompt,
                "max_tokens": spec.get("max_tokens", 8),
                "temperature": 0.0,
                "ignore_eos": True,
                "return_token_ids": True,
            }
            answer = post_completions(port, key, body)
            result["tokens"].append(list(answer["choices"][0]["token_ids"]))
            details = answer["usage"].get("prompt_tokens_details") or {}
            result["cached"].append(details.get("cached_tokens") or 0)
        result["generate_s"] = time.perf_counter() - started - start_s
        process.terminate()
        process.wait(timeout=300)
    finally:
        if process.poll() is None:
            process.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)  # engine processes left behind
        process.wait()
    if process.returncode not in (0, -signal.SIGTERM):
        raise RuntimeError(f"vllm serve exited with {process.returncode}: see {log}")
    result["total_s"] = time.perf_counter() - started
    return result


def wait_healthy(process: subprocess.Popen[bytes], port: int, log: Path) -> None:
    # A safety net for a server that never comes up, not a performance limit.
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"vllm serve exited with {process.returncode}: see {log}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                return
        except OSError:
            time.sleep(1)
    raise RuntimeError(f"vllm serve not healthy after 900 s: see {log}")


def post_completions(port: int, key: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
    )
    with urllib.request.urlopen(request, timeout=600) as response:
        answer: dict[str, Any] = json.loads(response.read())
        return answer


def main() -> None:
    if sys.argv[1] == "--make-model":
        sizes = [int(arg) for arg in sys.argv[3:5]]
        make_model(sys.argv[2], **dict(zip(("layers", "hidden"), sizes, strict=False)))
        return
    spec = json.loads(Path(sys.argv[1]).read_text())
    result = run(spec)
    Path(sys.argv[2]).write_text(json.dumps(result))
    # vLLM's in-process engine can take half a minute to exit on its own;
    # everything this run owed (kvtier's drain included) is done by now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":  # vLLM spawns processes: the guard is required
    main()
