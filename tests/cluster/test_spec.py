"""Job manifests: the AdaptDLJob file is validated with errors that name the field."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest

from adaptdl.cluster import (
    JobSpec,
    JobSpecError,
    check_launchable,
    load_job_file,
    parse_job_manifest,
)

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
                        "args": ["--epochs", "2"],
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


def test_a_long_generate_name_is_shortened_as_kubernetes_does() -> None:
    # It used to be refused as an invalid job name.
    doc = {**MANIFEST, "metadata": {"generateName": "a" * 80 + "-"}}
    name = parse_job_manifest(doc).name
    assert len(name) == 63 and name.startswith("a" * 57)
    for prefix, fragment in (
        ("Bad_", "generateName='Bad_' does not start a valid"),
        (5, "generateName=5"),
    ):
        doc = {**MANIFEST, "metadata": {"generateName": prefix}}
        with pytest.raises(JobSpecError, match=f"metadata.{fragment}"):
            parse_job_manifest(doc)


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
    jobs = root / "examples" / "jobs"
    spec = load_job_file(jobs / "mnist.yaml", working_dir=str(jobs))
    # Submitted as the target or with -f from examples/mnist, it runs there.
    assert Path(spec.working_dir) == root / "examples" / "mnist"
    assert (Path(spec.working_dir) / "main.py").is_file()
    again = load_job_file(jobs / "mnist.yaml", working_dir=str(root / "examples" / "mnist"))
    assert again.working_dir == spec.working_dir
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
    ("fields", "message"),
    [
        ({"command": ("py\0thon",)}, r"command\[0\]='py\\x00thon': contains a NUL byte"),
        ({"args": ("a", "b\0")}, r"args\[1\]='b\\x00': contains a NUL byte"),
        ({"env": {"K": "v\0"}}, r"env K='v\\x00': contains a NUL byte"),
        ({"working_dir": "/tmp\0x"}, r"workingDir='/tmp\\x00x': contains a NUL byte"),
    ],
)
def test_nul_bytes_are_not_launchable(fields: dict[str, Any], message: str) -> None:
    # No process can be started with one; before, the job was relaunched forever.
    spec = JobSpec(**{"name": "ok", "command": ("x",), **fields})
    # A spec stored by an older version still reads back (the check is at submission).
    assert JobSpec.from_json(spec.to_json()) == spec
    with pytest.raises(JobSpecError, match=message):
        check_launchable(spec)


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


_SPEC = (
    "metadata: {name: ok}\nspec:\n  maxReplicas: 2\n  template:\n    spec:\n"
    "      containers:\n        - name: main\n          command: [python3, main.py]\n"
)


def _load_error(path: Path, text: str) -> str:
    path.write_text(_HEAD + text)
    with pytest.raises(JobSpecError) as info:
        load_job_file(path, working_dir=str(path.parent))
    message = str(info.value)
    assert message.startswith(f"{path}: "), message
    return message


@pytest.mark.parametrize(
    ("old", "new", "fragment"),
    [
        ("  maxReplicas: 2", "  maxReplica: 2", "spec.maxReplica: unknown field (did you mean "),
        ("  maxReplicas: 2", "  maxRestart: 1", "spec.maxRestart: unknown field"),
        ("{name: ok}", "{name: ok, lables: {}}", "metadata.lables: unknown field"),
        ("metadata: {name: ok}", "spce: {}\nmetadata: {name: ok}", ": spce: unknown field"),
        ("    spec:\n", "    spec:\n      nodeSelectr: {}\n", "spec.template.spec.nodeSelectr"),
        (
            "          command",
            "          workDir: /tmp\n          command",
            "spec.template.spec.containers[0].workDir: unknown field (did you mean 'workingDir'?)",
        ),
    ],
)
def test_unknown_fields_are_rejected_naming_the_file_and_the_field(
    tmp_path: Path, old: str, new: str, fragment: str
) -> None:
    """A misspelt field would otherwise leave its default in force without a word."""
    body = _SPEC.replace(old, new)
    assert body != _SPEC
    message = _load_error(tmp_path / "job.yaml", body)
    assert fragment in message
    assert "; valid fields: " in message


def test_kubernetes_fields_without_local_meaning_are_accepted(tmp_path: Path) -> None:
    """A file written for Kubernetes (image, resources, volumes...) still runs here."""
    path = tmp_path / "job.yaml"
    path.write_text(
        _HEAD
        + "metadata: {name: ok, namespace: ml, labels: {team: a}}\n"
        + "spec:\n  maxReplicas: 2\n  template:\n    metadata: {labels: {a: b}}\n"
        + "    spec:\n      restartPolicy: Never\n      nodeSelector: {gpu: a100}\n"
        + "      volumes: [{name: data, emptyDir: {}}]\n      containers:\n"
        + "        - name: main\n          image: pytorch/pytorch\n"
        + "          imagePullPolicy: Always\n"
        + "          resources: {limits: {nvidia.com/gpu: 1}}\n"
        + "          volumeMounts: [{name: data, mountPath: /data}]\n"
        + "          command: [python3, main.py]\n"
    )
    spec = load_job_file(path, working_dir=str(tmp_path))
    assert spec.argv == ("python3", "main.py") and spec.max_replicas == 2


def test_a_second_container_or_init_containers_are_rejected(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    side = "        - name: sidecar\n          command: [sleep, '60']\n"
    message = _load_error(path, _SPEC + side)
    assert "spec.template.spec.containers lists 2 containers (main, sidecar)" in message
    assert "runs exactly one per replica" in message
    init = _SPEC.replace("    spec:\n", "    spec:\n      initContainers: [{name: i}]\n")
    message = _load_error(path, init)
    assert "spec.template.spec.initContainers: not supported by the local backend" in message


def test_working_dir_is_honoured_from_the_submitted_directory(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    path = tmp_path / "job.yaml"
    for written, expected in (("src", tmp_path / "src"), (str(tmp_path), tmp_path)):
        path.write_text(
            _HEAD
            + _SPEC.replace(
                "          command", f"          workingDir: {written}\n          command"
            )
        )
        assert load_job_file(path, working_dir=str(tmp_path)).working_dir == str(expected)
    message = _load_error(
        path,
        _SPEC.replace("          command", "          workingDir: /workspace\n          command"),
    )
    assert "spec.template.spec.containers[0].workingDir='/workspace': directory /workspace" in (
        message
    )
    (tmp_path / "main.py").write_text("")
    path.write_text(
        _HEAD
        + _SPEC.replace("          command", "          workingDir: main.py\n          command")
    )
    with pytest.raises(JobSpecError, match=f"directory {tmp_path / 'main.py'} is a file"):
        load_job_file(path, working_dir=str(tmp_path))


@pytest.mark.parametrize(
    ("field", "written", "read"),
    [
        ("args: [--step, 0012]", "args[1]=0012", "the integer 10"),
        ("args: [--lr, 1.50]", "args[1]=1.50", "the number 1.5"),
        ("args: [--verbose, on]", "args[1]=on", "the boolean true"),
        ("command: [python3, main.py, 2024-01-01]", "command[2]=2024-01-01", "the date"),
        ("env: [{name: UMASK, value: 0022}]", "env[0].value (UMASK)=0022", "the integer 18"),
        ("env: [{name: N, value: 1.50}]", "env[0].value (N)=1.50", "the number 1.5"),
    ],
)
def test_unquoted_values_yaml_would_convert_are_rejected(
    tmp_path: Path, field: str, written: str, read: str
) -> None:
    """``0012`` would silently become ``'10'``; Kubernetes refuses such values too."""
    path = tmp_path / "job.yaml"
    line = f"          {field}\n"
    text = _SPEC.replace("          command: [python3, main.py]\n", line)
    if not field.startswith("command"):
        text += "          command: [python3, main.py]\n"
    message = _load_error(path, text)
    quoted = written.split("=", 1)[1]
    assert (
        f"spec.template.spec.containers[0].{written}: YAML reads this unquoted value as {read}"
        in (message)
    )
    assert f'quote it: "{quoted}"' in message


def test_a_null_env_value_is_empty_as_in_kubernetes(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(_HEAD + _SPEC + "          env: [{name: EMPTY, value: }, {name: ABSENT}]\n")
    spec = load_job_file(path, working_dir=str(tmp_path))
    assert spec.env["EMPTY"] == "" and spec.env["ABSENT"] == ""


def test_from_json_refuses_env_values_without_one_spelling_and_unknown_fields() -> None:
    # The admin API stored {"A": None} as 'None' and ignored misspelt fields.
    base = JobSpec(name="j", command=("python", "x.py"), env={"N": "1"}).to_json()
    assert JobSpec.from_json(base).to_json() == base  # the wire format round-trips
    assert JobSpec.from_json({**base, "env": {"N": 3}}).env == {"N": "3"}
    for env, shown in (
        ({"A": None}, "env.A=None"),
        ({"B": [1, 2]}, "env.B=[1, 2]"),
        ({"C": True}, "env.C=True"),  # was stored as "True"
    ):
        with pytest.raises(JobSpecError, match=re.escape(shown) + ": expected a string"):
            JobSpec.from_json({**base, "env": env})
    unknown = re.escape("unknown field(s) maxReplica, zzz; valid fields: name")
    with pytest.raises(JobSpecError, match=unknown):
        JobSpec.from_json({**base, "maxReplica": 2, "zzz": 1})
    # The valid fields named are exactly those of the wire format.
    listed = ", ".join(base)
    with pytest.raises(JobSpecError, match=re.escape(f"valid fields: {listed}") + "$"):
        JobSpec.from_json({**base, "zzz": 1})


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        # A string was split into letters: "python main.py - - x" ran.
        ({"command": "python main.py"}, "command='python main.py': expected a sequence of strings"),
        ({"args": "--x"}, "args='--x': expected a sequence of strings"),
        ({"args": ("--n", 3)}, r"args\[1\]=3: expected a string"),
        ({"env": {"A": 1}}, "env 'A'=1: names and values must be strings"),
        ({"env": [("A", "1")]}, "env=.*expected a mapping"),
        ({"working_dir": 5}, "working_dir=5: expected a non-empty string"),
        ({"working_dir": ""}, "working_dir='': expected a non-empty string"),
        ({"preemptible": "no"}, "spec.preemptible='no': expected true or false"),
        ({"max_restarts": 10**20}, "spec.maxRestarts=10{20}: expected an integer from 0 to 2"),
        ({"max_replicas": 2**31}, "spec.maxReplicas=2147483648: expected an integer from 1"),
    ],
)
def test_job_spec_checks_every_field_it_is_made_with(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(JobSpecError, match=message):
        JobSpec(**{"name": "ok", "command": ("python", "main.py"), **fields})


def test_job_spec_normalises_lists_and_relative_directories(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A relative directory reached the daemon as ".", its own home.
    monkeypatch.chdir(tmp_path)
    spec = JobSpec(name="ok", command=["python", "main.py"], args=["--x"], working_dir="sub")  # type: ignore[arg-type]
    assert spec.command == ("python", "main.py") and spec.args == ("--x",)
    assert spec.working_dir == str(tmp_path / "sub")
    assert JobSpec(name="ok", command=("x",)).working_dir == os.path.join(str(tmp_path), ".")
    # Not normalised: ".." after a link is the link target's parent, as the OS resolves it.
    assert JobSpec(name="ok", command=("x",), working_dir="ln/..").working_dir == str(
        tmp_path / "ln/.."
    )
    assert JobSpec(name="ok", command=("x",), working_dir="/abs/../x").working_dir == "/abs/../x"
    assert JobSpec.from_json(spec.to_json()) == spec


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            _HEAD + "metadata: {name: ok}\nspec:\n  maxReplicas: 2\n  maxReplicas: 8\n",
            r"line 6: key 'maxReplicas' is given twice \(first on line 5\)",
        ),
        (
            _HEAD + _SPEC + "          env: [{name: A, value: x}, {name: A, value: y}]\n",
            "env\\[1\\]: variable 'A' is set twice",
        ),
    ],
)
def test_a_key_or_variable_given_twice_is_refused(tmp_path: Path, text: str, message: str) -> None:
    # YAML keeps the last value silently: maxReplicas 8, A=y.
    path = tmp_path / "job.yaml"
    path.write_text(text)
    with pytest.raises(JobSpecError, match=message):
        load_job_file(path, working_dir=str(tmp_path))


def test_the_duplicate_key_check_follows_yaml_rules(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    # A self-referencing anchor in an ignored field: a RecursionError traceback.
    looped = _SPEC.replace(
        "          command", "          securityContext: &l [*l]\n          command"
    )
    path.write_text(_HEAD + looped)
    assert load_job_file(path, working_dir=str(tmp_path)).name == "ok"
    # 1 and "1" are two keys; a flow mapping repeats one on a single line.
    path.write_text(_HEAD + "x-extra: {1: a, '1': b}\n" + _SPEC)
    with pytest.raises(JobSpecError, match="x-extra"):
        load_job_file(path, working_dir=str(tmp_path))  # an unknown field, not a duplicate
    path.write_text(
        _HEAD + _SPEC.replace("maxReplicas: 2", "maxReplicas: 2\n  preemptible: {a: 1, a: 2}")
    )
    with pytest.raises(JobSpecError, match=r"line 6: key 'a' is given twice \(first on line 6\)"):
        load_job_file(path, working_dir=str(tmp_path))
