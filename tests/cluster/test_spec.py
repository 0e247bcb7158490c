"""Job manifests: the AdaptDLJob file is validated with errors that name the field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from adaptdl.cluster import JobSpec, JobSpecError, load_job_file, parse_job_manifest

MANIFEST: dict[str, Any] = {
    "apiVersion": "adaptdl.petuum.com/v1",
    "kind": "AdaptDLJob",
    "metadata": {"name": "mnist"},
    "spec": {
        "minReplicas": 1,
        "maxReplicas": 4,
        "preemptible": True,
        "template": {
            "spec": {
                "containers": [
                    {
                        "name": "main",
                        "command": ["python3", "main.py"],
                        "args": ["--epochs", 2],
                        "env": [{"name": "FOO", "value": "bar"}],
                    }
                ]
            }
        },
    },
}


def test_manifest_round_trip() -> None:
    spec = parse_job_manifest(MANIFEST, working_dir="/tmp")
    assert spec.name == "mnist"
    assert spec.argv == ("python3", "main.py", "--epochs", "2")
    assert (spec.min_replicas, spec.max_replicas, spec.preemptible) == (1, 4, True)
    assert spec.env == {"FOO": "bar"}
    assert JobSpec.from_json(spec.to_json()) == spec


def test_overrides_and_generate_name() -> None:
    doc = {**MANIFEST, "metadata": {"generateName": "hello-"}}
    spec = parse_job_manifest(doc, args=["x"], max_replicas=2)
    assert spec.name.startswith("hello-") and len(spec.name) == len("hello-") + 6
    assert spec.args == ("x",)
    assert spec.max_replicas == 2


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        ({"kind": "Job"}, "kind='Job'"),
        ({"apiVersion": "v2"}, "apiVersion='v2'"),
        ({"metadata": {"name": "Bad_Name"}}, "job name 'Bad_Name'"),
        ({"spec": {"template": {"spec": {"containers": []}}}}, "containers must be"),
    ],
)
def test_bad_manifests(change: dict[str, object], fragment: str) -> None:
    with pytest.raises(JobSpecError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        parse_job_manifest({**MANIFEST, **change})


def test_min_above_max_names_both_fields() -> None:
    spec: dict[str, object] = dict(MANIFEST["spec"])
    spec.update(minReplicas=3, maxReplicas=2)
    with pytest.raises(JobSpecError, match="minReplicas=3 is greater than spec.maxReplicas=2"):
        parse_job_manifest({**MANIFEST, "spec": spec})


def test_load_job_file_errors(tmp_path: Path) -> None:
    bad = tmp_path / "job.yaml"
    bad.write_text("spec: [unclosed\n")
    with pytest.raises(JobSpecError, match="is not valid YAML"):
        load_job_file(bad)
    with pytest.raises(JobSpecError, match="cannot read job file"):
        load_job_file(tmp_path / "missing.yaml")
    bad.write_text(
        "spec:\n  minReplicas: two\n  template: {spec: {containers: [{command: [x]}]}}\n"
    )
    with pytest.raises(JobSpecError, match="spec.minReplicas='two'"):
        load_job_file(bad, name="ok")


def test_the_shipped_example_job_file_is_valid() -> None:
    root = Path(__file__).resolve().parents[2]
    spec = load_job_file(root / "examples" / "jobs" / "mnist.yaml", working_dir=".")
    assert spec.name.startswith("mnist-")
    assert spec.argv[:2] == ("python3", "main.py")
    assert (spec.min_replicas, spec.max_replicas, spec.max_restarts) == (0, 4, 3)
    assert spec.env == {"ADAPTDL_FIT_INTERVAL": "10"}


_HEAD = "apiVersion: adaptdl.petuum.com/v1\nkind: AdaptDLJob\n"
_CONTAINER = "  template: {spec: {containers: [{name: main, command: [python3, main.py]%s}]}}\n"


def _rejection(path: Path, container_fields: str) -> str:
    """Write a job file whose container has ``container_fields``; its load error."""
    path.write_text(_HEAD + "metadata: {name: ok}\nspec:\n" + _CONTAINER % container_fields)
    with pytest.raises(JobSpecError) as info:
        load_job_file(path)
    return str(info.value)


def test_env_value_from_is_rejected_naming_the_file_and_the_variable(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    env = ", env: [{name: A, value: x}, {name: TOKEN, valueFrom: {secretKeyRef: {name: s}}}]"
    message = _rejection(path, env)
    assert message.startswith(f"{path}: ")
    assert "env[1] (TOKEN): valueFrom is not supported by the local backend" in message


def test_env_from_is_rejected_naming_the_file_and_the_container(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    message = _rejection(path, ", envFrom: [{configMapRef: {name: settings}}]")
    assert message.startswith(
        f"{path}: spec.template.spec.containers[0].envFrom (main): envFrom is not supported "
        "by the local backend"
    )


def test_names_with_a_trailing_newline_are_rejected() -> None:
    with pytest.raises(JobSpecError, match="env name 'A\\\\n' is not a valid"):
        JobSpec(name="ok", command=("x",), env={"A\n": "1"})
    with pytest.raises(JobSpecError, match="job name 'ok\\\\n' is invalid"):
        JobSpec(name="ok\n", command=("x",))


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ("metadata: {name: Bad_Name}\nspec:\n" + _CONTAINER % "", "job name 'Bad_Name'"),
        (
            "metadata: {name: ok}\nspec:\n  minReplicas: 3\n  maxReplicas: 2\n" + _CONTAINER % "",
            "spec.minReplicas=3 is greater than spec.maxReplicas=2",
        ),
        (
            "metadata: {name: ok}\nspec:\n" + _CONTAINER % ", env: [{name: A-B, value: x}]",
            "env name 'A-B' is not a valid environment variable name",
        ),
        ("metadata: {name: ok}\nspec:\n  maxReplicas: 0\n" + _CONTAINER % "", "maxReplicas=0"),
        ("metadata: {name: ok}\nspec: {}\n", "spec.template must be a mapping"),
    ],
)
def test_every_job_file_error_starts_with_the_file_name(
    tmp_path: Path, body: str, fragment: str
) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(_HEAD + body)
    with pytest.raises(JobSpecError) as info:
        load_job_file(path)
    assert str(info.value).startswith(f"{path}: ")
    assert fragment in str(info.value)


def test_unreadable_job_files_are_named(tmp_path: Path) -> None:
    for path, fragment in (
        (tmp_path, "is a directory, not a job file"),
        (tmp_path / "missing.yaml", "cannot read job file"),
        (tmp_path / "binary.yaml", "is not a UTF-8 text (YAML) file"),
        (tmp_path / "bad.yaml", "is not valid YAML"),
    ):
        (tmp_path / "binary.yaml").write_bytes(b"\xff\xfe\x00bad")
        (tmp_path / "bad.yaml").write_text("spec: [oops\n")
        with pytest.raises(JobSpecError) as info:
            load_job_file(path)
        assert str(info.value).startswith(f"{path}: "), info.value
        assert fragment in str(info.value)
