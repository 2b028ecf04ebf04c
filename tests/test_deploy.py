"""The service files in deploy/: what this machine can check of them. The unit passes ``systemd-analyze verify``
and both run the daemon with options its command line accepts; running them needs a systemd host and a Kubernetes
cluster, which CI has not (the daemon as its own user, for a group, is tested in test_cache_security)."""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from weightstream.cli import _parser

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"


def unit_command() -> list[str]:
    text = (DEPLOY / "weightstream-cache.service").read_text().replace("\\\n", " ")
    line = next(line for line in text.splitlines() if line.startswith("ExecStart="))
    return shlex.split(line.removeprefix("ExecStart="))


def test_the_units_command_is_one_the_cli_accepts():
    command = unit_command()
    assert command[0].endswith("/bin/weightstream")
    args = _parser().parse_args(command[1:])
    assert (args.group, args.socket, args.budget) == ("inference", "/run/weightstream/cache.sock", 200 << 30)


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze here")
def test_the_unit_passes_systemd_analyze_verify(tmp_path):
    unit = (DEPLOY / "weightstream-cache.service").read_text()
    executable = str(Path(sys.executable).parent / "weightstream")
    (tmp_path / "weightstream-cache.service").write_text(unit.replace("/opt/weightstream/bin/weightstream", executable))
    result = subprocess.run(
        ["systemd-analyze", "verify", str(tmp_path / "weightstream-cache.service")],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "weightstream-cache.service" not in result.stderr, result.stderr


def test_the_daemonsets_command_is_one_the_cli_accepts():
    import yaml

    manifest = yaml.safe_load((DEPLOY / "weightstream-cache-daemonset.yaml").read_text())
    assert manifest["kind"] == "DaemonSet"
    (container,) = manifest["spec"]["template"]["spec"]["containers"]
    args = _parser().parse_args(container["args"])
    assert (args.group, args.budget, args.dir) == ("10002", 200 << 30, "/dev/shm/weightstream-cache")
    probe = _parser().parse_args(container["readinessProbe"]["exec"]["command"][1:])
    assert probe.cache_command == "stats"
    assert manifest["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True


def test_the_fleets_daemonset_joins_a_fleet_and_its_policy_admits_only_its_peers():
    import yaml

    daemonset, policy = yaml.safe_load_all((DEPLOY / "weightstream-cache-fleet.yaml").read_text())
    (container,) = daemonset["spec"]["template"]["spec"]["containers"]
    args = _parser().parse_args(container["args"])
    assert (args.fleet, args.fleet_node) == (["etcd://etcd.weightstream:2379/models"], "$(NODE_NAME)")
    environment = {item["name"]: item for item in container["env"]}
    assert environment["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert environment["UCX_NET_DEVICES"]["value"] == "eth0"
    plain = yaml.safe_load((DEPLOY / "weightstream-cache-daemonset.yaml").read_text())
    (alone,) = plain["spec"]["template"]["spec"]["containers"]
    assert container["args"][: len(alone["args"])] == alone["args"], "the fleet's daemon differs beyond --fleet"
    assert policy["kind"] == "NetworkPolicy"
    assert policy["spec"]["podSelector"] == {"matchLabels": daemonset["spec"]["selector"]["matchLabels"]}
    (ingress,) = policy["spec"]["ingress"]
    assert ingress["from"] == [{"podSelector": {"matchLabels": daemonset["spec"]["selector"]["matchLabels"]}}]


def test_the_containerfile_builds_what_the_daemonsets_run():
    """deploy/Containerfile (not built here: no base-image registry is reachable): torch from the CPU index before
    anything that requires it, extras that exist, the DaemonSets' uid, weightstream as the entry point with a command
    the CLI accepts; the unit's documentation link names a heading that exists."""
    import json
    import re

    import yaml

    tomllib = pytest.importorskip("tomllib", reason="Python 3.11's TOML parser")
    text = (DEPLOY / "Containerfile").read_text()
    steps = [line for line in text.splitlines() if line and not line.startswith("#")]
    torch_step = next(index for index, line in enumerate(steps) if "torch==" in line)
    weightstream_step = next(index for index, line in enumerate(steps) if "/src[" in line)
    assert "download.pytorch.org/whl/cpu" in steps[torch_step] and torch_step < weightstream_step
    extras = set(re.search(r"/src\[([\w,]+)\]", steps[weightstream_step])[1].split(","))
    declared = tomllib.loads((DEPLOY.parent / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras <= set(declared), extras - set(declared)
    assert "USER 10001:10001" in steps
    assert json.loads(next(line for line in steps if line.startswith("ENTRYPOINT"))[len("ENTRYPOINT") :]) == [
        "weightstream"
    ]
    command = json.loads(next(line for line in steps if line.startswith("CMD"))[len("CMD") :])
    assert _parser().parse_args(command).cache_command == "serve"
    for manifest in ("weightstream-cache-daemonset.yaml", "weightstream-cache-fleet.yaml"):
        documents = yaml.safe_load_all((DEPLOY / manifest).read_text())
        (daemons,) = [document for document in documents if document["kind"] == "DaemonSet"]
        assert daemons["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == 10001
    link = next(
        line for line in (DEPLOY / "weightstream-cache.service").read_text().splitlines() if "Documentation=" in line
    )
    page, anchor = link.split("/blob/main/")[1].split("#")
    headings = re.findall(r"^#+ (.+)$", (DEPLOY.parent / page).read_text(), re.MULTILINE)
    assert anchor in {re.sub(r"[^\w -]", "", heading).strip().lower().replace(" ", "-") for heading in headings}
