"""An environment server any rollout node can play over HTTP (stdlib ``http.server``).

API (JSON in, JSON out):

- ``POST /start {"env": "rooms"|"shop"|"terminal", "seed": int}`` → ``{"episode_id", "observation", "done": false}``
- ``POST /step {"episode_id", "action": str}`` → ``{"observation", "reward", "done"}``
- ``POST /close {"episode_id"}`` → ``{"closed": true}``
- ``GET /health`` → ``{"ok": true, "envs": [...], "open": n}``

Run one with ``python -m astraflow.rollout.envs.server --port 8765``; tests embed one with
:func:`serve_in_thread`. The ``env_http`` workflow speaks this API to any server.
"""

from __future__ import annotations

import argparse
import json
import threading
import uuid
from http.server import ThreadingHTTPServer

from astraflow.registry import UnknownName
from astraflow.rollout.envs.games import ENVIRONMENTS, Game
from astraflow.rollout.http_json import JsonHandler


class EnvServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, addr: tuple[str, int]) -> None:
        super().__init__(addr, _Handler)
        self.episodes: dict[str, Game] = {}
        self.lock = threading.Lock()
        self.stats = {"started": 0, "steps": 0, "closed": 0}

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host!s}:{port}"


class _Handler(JsonHandler):
    server: EnvServer

    def do_GET(self) -> None:
        if self.path == "/health":
            return self._reply(200, {"ok": True, "envs": ENVIRONMENTS.names(), "open": len(self.server.episodes)})
        self._reply(404, {"error": f"no route {self.path}"})

    def do_POST(self) -> None:
        try:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        except json.JSONDecodeError as e:
            return self._reply(400, {"error": f"bad json: {e}"})
        s = self.server
        if self.path == "/start":
            env = body.get("env", "rooms")
            try:
                new_game = ENVIRONMENTS.get(env)
            except UnknownName as e:
                return self._reply(400, {"error": str(e)})
            game = new_game(int(body.get("seed", 0)))
            eid = uuid.uuid4().hex
            with s.lock:
                s.episodes[eid] = game
                s.stats["started"] += 1
            return self._reply(200, {"episode_id": eid, "observation": game.reset(), "done": False})
        playing = s.episodes.get(body.get("episode_id", ""))
        if self.path == "/step":
            if playing is None:
                return self._reply(404, {"error": "unknown episode_id"})
            obs, reward, done = playing.step(str(body.get("action", "")))
            with s.lock:
                s.stats["steps"] += 1
            return self._reply(200, {"observation": obs, "reward": reward, "done": done})
        if self.path == "/close":
            with s.lock:
                closing = s.episodes.pop(body.get("episode_id", ""), None)
                s.stats["closed"] += 1
            if closing is not None:
                closing.close()
            return self._reply(200, {"closed": True})
        self._reply(404, {"error": f"no route {self.path}"})


def serve_in_thread(host: str = "127.0.0.1", port: int = 0) -> EnvServer:
    """Start a server on a daemon thread; ``server.shutdown()`` stops it."""
    server = EnvServer((host, port))
    threading.Thread(target=server.serve_forever, name="env-server", daemon=True).start()
    return server


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8765)
    args = ap.parse_args()
    server = EnvServer((args.host, args.port))
    print(f"environment server on {server.url} ({', '.join(ENVIRONMENTS.names())})", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
