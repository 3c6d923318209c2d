"""What the server-backed engines (sglang, vllm) share: JSON over HTTP, a launched server's
lifecycle, staging weight versions on disk, and a lock that keeps weight updates and
generation apart.

A weight version reaches a server as a directory the server loads from (``model.safetensors``
plus the model's config and tokenizer files), written by the node into the engine's
``weight_staging_dir`` (default: a temp dir under ``/dev/shm``). The server must see that
path: it runs on the node's host, launched by the node or attached with the engine's ``url``
(``ServerOptions`` in ``options.py``). The previous version's directory is removed only after the server
has loaded the new one.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from astraflow.config import ModelConfig
    from astraflow.rollout.engines.base import Completion, GenerationRequest, SamplingParams
    from astraflow.rollout.engines.options import ServerOptions

log = logging.getLogger(__name__)


class EngineHTTPError(RuntimeError):
    """A server answered with an error status (or not at all); the message has its reply."""

    def __init__(self, url: str, status: int, text: str) -> None:
        super().__init__(f"{url} -> HTTP {status}: {text[:500]}")
        self.status = status


def http_json(url: str, body: Any = None, method: str | None = None, timeout: float = 600.0) -> Any:
    """POST ``body`` as JSON (GET when None) and decode the JSON reply ({} for an empty one)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method or ("GET" if body is None else "POST"),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
    except urllib.error.HTTPError as e:
        raise EngineHTTPError(url, e.code, e.read().decode(errors="replace")) from None
    except (urllib.error.URLError, OSError) as e:
        raise EngineHTTPError(url, 0, str(e)) from None
    if not raw.strip():
        return {}
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return {"text": raw.decode(errors="replace")}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_LIBC = ctypes.CDLL("libc.so.6", use_errno=True) if sys.platform.startswith("linux") else None  # loaded before any fork


def _ended_with_parent() -> None:
    """preexec hook: the kernel sends this child SIGTERM when the thread that started it ends (Linux's
    ``PR_SET_PDEATHSIG``), so a server outlives no node killed with SIGKILL. Only a call into the loaded libc."""
    if _LIBC is not None:
        _LIBC.prctl(1, signal.SIGTERM)


class ServerProcess:
    """A server the node launched: its own session (a terminal's Ctrl-C to a node started by hand leaves it serving the
    tasks the node drains), a log file, stopped with the node; and, launched from the node's main thread, sent SIGTERM
    by the kernel if the node dies without stopping it."""

    def __init__(self, cmd: list[str], env: dict[str, str] | None, log_path: Path) -> None:
        self.cmd = cmd
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        on_main = threading.current_thread() is threading.main_thread()  # a worker thread may end before the node does
        with open(log_path, "ab") as logf:
            self.proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env={**os.environ, **(env or {})}, start_new_session=True,
                                         preexec_fn=_ended_with_parent if on_main else None)

    def wait_healthy(self, url: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"engine server exited with {self.proc.returncode}; see {self.log_path}")
            try:
                http_json(url, timeout=5.0)
                return
            except EngineHTTPError:
                time.sleep(1.0)
        raise TimeoutError(f"engine server not healthy at {url} after {timeout:.0f}s; see {self.log_path}")

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        except ProcessLookupError:
            pass


class WeightStager:
    """Writes each weight version as a loadable model directory; keeps the current one until the next loads."""

    def __init__(self, base: str | None, template_dir: Path, scratch: Path | None = None) -> None:
        self.scratch = scratch  # removed with the stager (the initial model, the template)
        root = base or ("/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None)
        self.root = Path(tempfile.mkdtemp(prefix="astraflow-weights-", dir=root))
        self.template = template_dir  # config, tokenizer, generation config: copied next to every version
        self.current: Path | None = None

    def stage(self, state: Mapping[str, torch.Tensor], version: int) -> Path:
        import torch
        from safetensors.torch import save_file

        path = self.root / f"v{version}"
        if path.exists():
            shutil.rmtree(path)
        path.mkdir(parents=True)
        for f in self.template.iterdir():
            if f.is_file() and not f.name.endswith((".safetensors", ".bin", ".pt")) and f.name != "model.safetensors.index.json":
                shutil.copy2(f, path / f.name)
        tensors = {k: v.detach().to("cpu", torch.bfloat16).contiguous() for k, v in state.items()}
        save_file(_untie(tensors), str(path / "model.safetensors"))
        return path

    def stage_adapter(self, adapters: Mapping[str, torch.Tensor], scale: float, version: int) -> Path:
        """A LoRA version (``m.lora_A`` / ``m.lora_B`` per adapted layer ``m``: weights/adapters.py) as a PEFT adapter
        directory, the format the servers' LoRA support loads: ``adapter_config.json`` (rank, alpha = scale x rank, the
        target modules) and ``adapter_model.safetensors`` (``base_model.model.{m}.lora_A.weight``, …)."""
        import torch
        from safetensors.torch import save_file

        from astraflow.weights.adapters import A, B, adapted_layers

        layers = adapted_layers(adapters)
        rank = int(adapters[layers[0] + A].shape[0])
        path = self.root / f"adapter-v{version}"
        if path.exists():
            shutil.rmtree(path)
        path.mkdir(parents=True)
        tensors = {f"base_model.model.{m}.{part}.weight": adapters[m + suffix].detach().to("cpu", torch.bfloat16).contiguous()
                   for m in layers for part, suffix in (("lora_A", A), ("lora_B", B))}
        save_file(tensors, str(path / "adapter_model.safetensors"))
        config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": scale * rank, "lora_dropout": 0.0,
                  "bias": "none", "target_modules": sorted({m.rsplit(".", 1)[-1] for m in layers}), "base_model_name_or_path": None}
        (path / "adapter_config.json").write_text(json.dumps(config))
        return path

    def commit(self, path: Path) -> None:
        """``path`` is loaded: the previous version's directory can go."""
        if self.current is not None and self.current != path:
            shutil.rmtree(self.current, ignore_errors=True)
        self.current = path

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)


def _untie(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors sharing memory (tied embeddings): give each its own copy."""
    seen: dict[int, str] = {}
    out = {}
    for k, v in tensors.items():
        ptr = v.data_ptr()
        out[k] = v.clone() if ptr in seen else v
        seen.setdefault(ptr, k)
    return out


def model_dir(model_cfg: ModelConfig, tokenizer: Any, where: Path) -> str:
    """A directory or hub id the server can load at start: ``pretrained``, or the recipe's tiny model saved to ``where``
    and then moved to a path named by its files' digest (``saved_once``)."""
    if model_cfg.pretrained:
        return model_cfg.pretrained
    from astraflow.models import build_model

    where.mkdir(parents=True, exist_ok=True)
    build_model(model_cfg, tokenizer).save_pretrained(where)
    tokenizer.save_pretrained(where)
    return str(saved_once(where))


def saved_once(where: Path) -> Path:
    """``where``'s files under one path per content, ``{tmp}/astraflow-model-{files_digest}``, shared by every node and
    run that saves the same model. A server's compile cache is keyed by the model's path (vLLM's
    ``torch_compile_cache``): a temp dir per start would make it compile again at every start, about 20 s on CPU for
    the tiny models. The move is atomic; a process that finds the path taken by the same files drops its own copy, and
    one taken by other files (changed since) is replaced. Where it cannot be (another user's), ``where`` is kept."""
    digest = files_digest(where)
    final = Path(tempfile.gettempdir()) / f"astraflow-model-{digest[:32]}"
    for _ in range(3):
        if final.is_dir() and files_digest(final) == digest:
            shutil.rmtree(where, ignore_errors=True)
            return final
        shutil.rmtree(final, ignore_errors=True)
        try:
            os.rename(where, final)
            return final
        except OSError:  # another process moved its copy there first: check that one
            continue
    log.warning("the model's files could not be shared at %s; loading them from %s (compiled again at every start)", final, where)
    return where


def files_digest(folder: Path) -> str:
    """sha256 over a folder's files, names and bytes, in name order."""
    h = hashlib.sha256()
    for f in sorted(p for p in folder.iterdir() if p.is_file()):
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def model_digest(model_cfg: ModelConfig, tokenizer: Any) -> str:
    """The bf16 state digest of the model a server loads (``model_dir``'s): the base LoRA versions must adapt."""
    from astraflow.models import build_model
    from astraflow.weights.delta import state_digest, to_bf16_state

    return state_digest(to_bf16_state(build_model(model_cfg, tokenizer).state_dict()))


def template_dir(model_path: str, where: Path) -> Path:
    """A local directory with the model's config and tokenizer files (a hub id is resolved through transformers)."""
    p = Path(model_path)
    if p.is_dir():
        return p
    from transformers import AutoConfig, AutoTokenizer

    where.mkdir(parents=True, exist_ok=True)
    AutoConfig.from_pretrained(model_path).save_pretrained(where)
    AutoTokenizer.from_pretrained(model_path).save_pretrained(where)
    return where


class RWLock:
    """Many generations at once, or one weight update alone (an update waits for those in flight, blocks new ones)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._writer = False
        self.waiting_writers = 0  # observable: an update waiting for generation in flight

    @contextmanager
    def read(self) -> Iterator[None]:
        with self._cond:
            while self._writer or self.waiting_writers:  # a waiting update goes first: no starvation
                self._cond.wait()
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                self._cond.notify_all()

    @contextmanager
    def write(self) -> Iterator[None]:
        with self._cond:
            self.waiting_writers += 1
            while self._writer or self._readers:
                self._cond.wait()
            self.waiting_writers -= 1
            self._writer = True
        try:
            yield
        finally:
            with self._cond:
                self._writer = False
                self._cond.notify_all()


class RemoteEngine:
    """Base of the server-backed engines: URL, launched server, staging, version, locking."""

    health_path = "/health"

    def __init__(self, url: str, server: ServerProcess | None, stager: WeightStager, tokenizer: Any) -> None:
        self.url = url.rstrip("/")
        self.server = server
        self.stager = stager
        self.tokenizer = tokenizer
        self._version = -1
        self._state: Mapping[str, Any] = {}
        self.lock = RWLock()

    @property
    def version(self) -> int:
        return self._version

    def state_view(self) -> Mapping[str, Any]:
        return self._state

    def expect_callers(self, n: int) -> None:
        """Nothing to do: the server batches concurrent requests itself."""

    def generate(self, requests: list[GenerationRequest]) -> list[Completion]:
        """One server call per distinct sampling params, under the read lock (a weight update waits)."""
        groups: dict[SamplingParams, list[int]] = {}
        for i, r in enumerate(requests):
            groups.setdefault(r.params, []).append(i)
        out: list[Completion | None] = [None] * len(requests)
        with self.lock.read():
            version = self._version
            for params, idx in groups.items():
                for i, completion in zip(idx, self.generate_group([requests[i].prompt_ids for i in idx], params, version)):
                    out[i] = completion
        return [c for c in out if c is not None]

    def generate_group(self, prompts: list[list[int]], params: SamplingParams, version: int) -> list[Completion]:
        """One completion per prompt, all with ``params``, tagged with ``version``; a server's own call."""
        raise NotImplementedError

    def post(self, route: str, body: Any = None, timeout: float = 600.0, method: str | None = None) -> Any:
        return http_json(f"{self.url}{route}", {} if body is None and method != "GET" else body, method=method, timeout=timeout)

    def post_optional(self, route: str, body: Any = None) -> bool:
        """An endpoint older servers may lack: False on 404/405 instead of an error."""
        try:
            self.post(route, body)
            return True
        except EngineHTTPError as e:
            if e.status in (404, 405):
                log.debug("%s has no %s", self.url, route)
                return False
            raise

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
        self.stager.close()


def prepare(name: str, model_cfg: ModelConfig, options: ServerOptions, tokenizer: Any) -> tuple[str, WeightStager]:
    """(model path for the server, stager): the model directory and where versions will be written."""
    scratch = Path(tempfile.mkdtemp(prefix=f"astraflow-{name}-"))
    path = model_dir(model_cfg, tokenizer, scratch / "initial")
    stager = WeightStager(options.weight_staging_dir, template_dir(path, scratch / "template"), scratch)
    return path, stager
