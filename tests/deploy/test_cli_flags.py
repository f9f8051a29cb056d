"""deploy/: every command line and environment variable in the manifests is one epd
accepts: each container's arguments parse with epd's own argparse parser (`epd serve` /
`epd worker`, exact option names, no abbreviations), under the environment the pod
gives it; every EPD_* variable is read by epd's code, every other one is UCX's or a
helper that another variable or argument uses."""

from __future__ import annotations

import argparse
import contextlib
import io
import re

import pytest

from tests.deploy.manifests import (
    EPD_ENV,
    HELPER_ENV,
    RENDERED,
    ROOT,
    UCX_ENV,
    container_env,
    containers,
    expand,
    render,
    unresolved_vars,
)


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            if name in action.choices:
                return action.choices[name]
            pytest.fail(f"`epd {name}` does not exist (epd has: {sorted(action.choices)})", pytrace=False)
    raise AssertionError("epd's parser has no subcommands")


def _command_lines(overlay: str):
    for w, _t, c in containers(render(overlay)):
        env = container_env(c)
        argv = [expand(a, env) for a in list(c.get("command", [])) + list(c.get("args", []))]
        yield f"{overlay}:{w['kind']}/{w['metadata']['name']}/{c['name']}", argv, env


def check_command_line(where: str, argv: list[str], env: dict[str, str], monkeypatch) -> list[str]:
    """What is wrong with running ``argv`` under ``env`` (empty: nothing)."""
    from epd.cli import build_parser

    if argv[:1] != ["epd"] or argv[1:2] not in (["serve"], ["worker"]):
        return [f"{where}: runs {' '.join(argv[:2])!r}, not `epd serve` / `epd worker`"]
    if unresolved_vars(" ".join(argv)):
        return [f"{where}: unexpanded {unresolved_vars(' '.join(argv))}"]
    failures = []
    with monkeypatch.context() as m:
        for k, v in env.items():
            m.setenv(k, v)
        parser = build_parser()  # under the pod's environment: defaults may come from EPD_* variables
        sub = _subparser(parser, argv[1])
        known = set(sub._option_string_actions)
        for a in argv[2:]:
            if a.startswith("--") and a.split("=", 1)[0] not in known:
                failures.append(f"{where}: `epd {argv[1]}` has no option {a.split('=', 1)[0]}")
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                ns = parser.parse_args(argv[1:])
        except SystemExit:
            return failures + [f"{where}: epd {' '.join(argv[1:])}\n    {err.getvalue().strip()}"]
    # What `epd worker` / `epd serve` check right after parsing (option or environment):
    # a worker needs its instance id and router; a pod binds beyond loopback, so keys;
    # a worker is rank 0 of its instance (it starts ranks 1.. itself: no rank per pod),
    # and the manifests leave --rank out altogether.
    needed = {"cluster_keys": "EPD_CLUSTER_KEYS"}
    if argv[1] == "serve" and ns.require_api_key:  # `epd serve --require-api-key` refuses to start without one
        needed["api_key"] = "EPD_API_KEY"
    if argv[1] == "worker":
        needed.update(instance_id="EPD_INSTANCE_ID", router="EPD_ROUTER")
        if ns.rank != 0:
            failures.append(f"{where}: --rank={ns.rank}: `epd worker` refuses ranks >= 1 (rank 0 starts them)")
        elif any(a == "--rank" or a.startswith("--rank=") for a in argv[2:]):
            failures.append(f"{where}: passes --rank (always 0: leave it out)")
    failures += [f"{where}: neither --{n.replace('_', '-')} nor ${var}" for n, var in needed.items()
                 if not (getattr(ns, n, None) or env.get(var))]
    return failures


@pytest.mark.parametrize("overlay", RENDERED)
def test_every_command_line_parses_with_epds_parser(overlay, monkeypatch):
    """`epd serve ...` / `epd worker ...` exactly as the pods run them: argparse accepts
    them (required options given, here by the pod's EPD_* variables; values of the right
    type and choice), every option is spelt out in full, no $(VAR) is left unexpanded."""
    failures = []
    for where, argv, env in _command_lines(overlay):
        failures += check_command_line(where, argv, env, monkeypatch)
    assert not failures, "\n".join(failures)


def test_the_command_line_check_catches_mistakes(monkeypatch):
    """The check above fails on an unknown option, an abbreviation argparse would accept,
    a bad choice or type, a missing router or keys directory, an unexpanded variable,
    a --rank (>= 1: refused by `epd worker`; 0: redundant) and the API's missing key."""
    where, argv, env = next(x for x in _command_lines("cpu") if "epd-decode" in x[0])
    assert check_command_line(where, argv, env, monkeypatch) == []
    bad = {
        "unknown option": (argv + ["--drain-seconds=5"], env),
        "abbreviation": ([a.replace("--drain-timeout=", "--drain-time=") for a in argv], env),
        "bad choice": ([a.replace("--role=decode", "--role=decoder") for a in argv], env),
        "bad type": ([a.replace("--http-port=9100", "--http-port=http") for a in argv], env),
        "missing router": (argv, {k: v for k, v in env.items() if k != "EPD_ROUTER"}),
        "missing keys": (argv, {k: v for k, v in env.items() if k != "EPD_CLUSTER_KEYS"}),
        "unexpanded": (argv + ["--model=$(MODEL_DIR)"], env),
        "a rank >= 1": (argv + ["--tp=2", "--rank=1"], env),
        "a --rank at all": (argv + ["--rank=0"], env),
    }
    for what, (a, e) in bad.items():
        assert check_command_line(where, a, e, monkeypatch), f"{what} went unnoticed"
    where, argv, env = next(x for x in _command_lines("cpu") if "epd-api" in x[0])
    assert check_command_line(where, argv, env, monkeypatch) == []
    no_key = {k: v for k, v in env.items() if k != "EPD_API_KEY"}
    assert check_command_line(where, argv, no_key, monkeypatch), "--require-api-key without a key went unnoticed"


@pytest.mark.parametrize("overlay", RENDERED)
def test_environment_variables_are_read_by_someone(overlay):
    """EPD_* variables: in the known list and read by epd's code (their name appears in
    epd/ or router/); UCX_*: UCX's own; anything else: a helper used as $(NAME)."""
    sources = "\n".join(p.read_text(encoding="utf-8") for d in ("epd", "router")
                        for p in (ROOT / d).rglob("*.py"))
    failures = []
    for w, _t, c in containers(render(overlay)):
        where = f"{overlay}:{w['metadata']['name']}/{c['name']}"
        names = [e["name"] for e in c.get("env", [])]
        assert len(names) == len(set(names)), f"{where}: duplicate env {names}"
        used = " ".join(c.get("args", []) + [e.get("value", "") for e in c.get("env", [])])
        for name in names:
            if name.startswith("EPD_"):
                if name not in EPD_ENV:
                    failures.append(f"{where}: {name} is not a variable epd documents")
                elif not re.search(rf"[\"']{name}[\"']", sources):
                    failures.append(f"{where}: {name} ({EPD_ENV[name]}) is read nowhere in epd/ or router/")
            elif name.startswith("UCX_"):
                if name not in UCX_ENV:
                    failures.append(f"{where}: {name} is not one of the UCX variables epd documents")
            elif name not in HELPER_ENV:
                failures.append(f"{where}: {name} is neither epd's nor UCX's")
            elif f"$({name})" not in used:
                failures.append(f"{where}: helper {name} is used by nothing")
    assert not failures, "\n".join(failures)


def test_the_tts_command_line_is_one_epd_runs(monkeypatch):
    """The tts pool's worker (components/tts) on every overlay: `epd worker --role=tts`
    parses, its --tts-engine is an engine epd.tts.load_synthesizer has (argparse takes any
    string there, so the parser alone would not notice a wrong one), and the check above
    catches a wrong role or a misspelt option on this command line too."""
    from epd.tts import ENGINES

    for overlay in RENDERED:
        if "+tts" not in overlay:
            continue
        (where, argv, env), = [x for x in _command_lines(overlay) if "/epd-tts/" in x[0]]
        assert check_command_line(where, argv, env, monkeypatch) == []
        engine = next(a.split("=", 1)[1] for a in argv if a.startswith("--tts-engine="))
        assert engine in ENGINES, f"{where}: --tts-engine={engine}: epd.tts has {ENGINES}"
    bad = {"bad role": [a.replace("--role=tts", "--role=speech") for a in argv],
           "abbreviation": [a.replace("--tts-engine=", "--tts-eng=") for a in argv]}
    for what, a in bad.items():
        assert check_command_line(where, a, env, monkeypatch), f"{what} went unnoticed"
