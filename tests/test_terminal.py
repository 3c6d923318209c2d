"""The terminal game: a restricted shell over a scratch directory (run in the sandbox), checked by its final state."""

from __future__ import annotations

from pathlib import Path

import pytest

from astraflow.rollout.envs.server import serve_in_thread
from astraflow.rollout.envs.shell import Refused, parse, run_command
from astraflow.rollout.envs.terminal import Terminal
from astraflow.rollout.rewards.sandbox import Sandbox
from astraflow.rollout.workflows.env import EnvClient

BOX = Sandbox(timeout_s=5.0, cpu_s=2, memory_mb=256, file_mb=1)


@pytest.fixture
def scratch(tmp_path: Path) -> Path:
    (tmp_path / "a.txt").write_text("alpha KEY\n")
    (tmp_path / "b.txt").write_text("beta\n")
    return tmp_path


@pytest.mark.parametrize("line", ["cat /etc/passwd", "ls ..", "cp a.txt ../x", "grep --file=/etc/hosts x", "cat ~/x", "ls a/../../b"])
def test_paths_outside_the_directory_are_refused(scratch: Path, line: str):
    with pytest.raises(Refused, match="inside the working directory"):
        parse(line, scratch)
    assert run_command(line, scratch, BOX).startswith("error: ")


@pytest.mark.parametrize("line", ["bash -c ls", "python3 -c 1", "find . -exec rm {} ;", "ln -s / x", "sh"])
def test_only_listed_programs_run(scratch: Path, line: str):
    assert "command not found" in run_command(line, scratch, BOX)


def test_globs_redirection_and_no_shell(scratch: Path):
    assert run_command("grep -l KEY *.txt", scratch, BOX) == "a.txt"
    assert run_command("echo hi > c.txt", scratch, BOX) == "" and (scratch / "c.txt").read_text() == "hi\n"
    assert run_command("echo again >> c.txt", scratch, BOX) == "" and (scratch / "c.txt").read_text() == "hi\nagain\n"
    assert run_command("echo $(rm a.txt); rm b.txt", scratch, BOX) == "$(rm a.txt); rm b.txt"  # text, not shell
    assert (scratch / "a.txt").exists() and (scratch / "b.txt").exists()
    assert run_command("cat 'unclosed", scratch, BOX).startswith("error: syntax error")
    assert "No such file" in run_command("cat nothing.txt", scratch, BOX)


def play(seed: int, actions: list[str]) -> tuple[Terminal, list[tuple[str, float, bool]]]:
    game = Terminal(seed)
    game.reset()
    return game, [game.step(a) for a in actions]


def solve(game: Terminal) -> str:
    return {"copy": f"cp {game.target} found.txt", "move": f"mv {game.target} keep/", "delete": f"rm {game.target}"}[game.verb]


@pytest.mark.parametrize("seed", range(6))
def test_looking_then_acting_solves_every_task(seed: int):
    game = Terminal(seed)
    assert game.keyword in game.reset() and all(n in game.reset() for n in game.files)
    out, reward, done = game.step(f"grep -l {game.keyword} *.txt")
    assert (out, reward, done) == (game.target, 0.0, False)  # the output names the file
    assert game.step(solve(game))[1:] == (0.0, False)  # no reward before the end
    out, reward, done = game.step("exit")
    assert (reward, done) == (1.0, True) and "task done" in out
    game.close()
    assert not game.root.exists()


def test_the_checker_reads_the_final_state():
    seeds = {}
    for s in range(30):
        probe = Terminal(s)
        seeds[probe.verb] = s
        probe.close()  # each game owns a scratch directory
    assert set(seeds) == {"copy", "move", "delete"}
    for verb, seed in seeds.items():
        game = Terminal(seed)
        wrong = next(n for n in game.files if n != game.target)
        acted = {"copy": f"cp {wrong} found.txt", "move": f"mv {wrong} keep/", "delete": f"rm {wrong}"}[verb]
        assert game.step(acted)[1] == 0.0 and game.step("exit")[1:] == (0.0, True), verb  # the wrong file
        game.close()
        game = Terminal(seed)
        game.step(solve(game))
        game.step(f"rm {wrong}")  # done, but another file was lost
        assert game.step("exit")[1] == 0.0, verb
        game.close()


def test_the_step_limit_ends_and_checks():
    game = Terminal(0, max_steps=2)
    game.step("ls")
    out, reward, done = game.step(solve(game))
    assert done and reward == 1.0 and "out of steps" in out
    game.close()


def test_the_server_closes_what_an_episode_holds():
    server = serve_in_thread()
    try:
        client = EnvClient(server.url)
        started = client.start("terminal", 4)
        game = server.episodes[started["episode_id"]]
        assert "Task: " in started["observation"] and game.root.exists()
        client.step(started["episode_id"], "ls")
        client.close(started["episode_id"])
        assert not game.root.exists() and not server.episodes
    finally:
        server.shutdown()
