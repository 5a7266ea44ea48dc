"""gpuctl datasets create, list, show, add-version and upload, and submit --dataset, against a live portal."""
import json

from portal.storage.datasets import dataset_version_inspect
from portal.storage.models import DatasetVersion


def test_a_dataset_is_created_versioned_and_named_by_a_job(portal, gpuctl, tmp_path, http_files):
    url = http_files.put("set.bin", b"version one")
    created = gpuctl("datasets", "create", "vision", "tiny", "--url", url, "--description", "a set", "-o", "json")
    assert created.exit_code == 0, created.stderr
    dataset = json.loads(created.stdout)
    assert dataset["mount_path"] == "/datasets/tiny" and dataset["versions"][0]["state"] == "pending"
    dataset_version_inspect(DatasetVersion.objects.get(dataset_id=dataset["id"]).pk)  # the portal's worker's job

    local = tmp_path / "two.tar"
    local.write_bytes(b"x" * 10)
    up = gpuctl("datasets", "upload", dataset["id"], local)
    assert up.exit_code == 0 and "Version 2: 10 bytes" in up.stdout, up.stderr
    listed = gpuctl("datasets", "list", "-p", "vision")
    assert listed.exit_code == 0 and "tiny" in listed.stdout and "/datasets/tiny" in listed.stdout
    shown = gpuctl("datasets", "show", dataset["id"])
    assert shown.exit_code == 0 and "ready" in shown.stdout and "upload:two.tar" in shown.stdout and url in shown.stdout

    job = gpuctl("submit", "-p", "vision", "--image", "gpuportal/busybox:latest", "--dataset", "tiny@1", "-o", "json",
                 "--", "true")
    assert job.exit_code == 0, job.stderr
    (entry,) = json.loads(job.stdout)["datasets"]
    assert (entry["name"], entry["version"], entry["size"]) == ("tiny", 1, len(b"version one"))


def test_bad_input_names_the_field(portal, gpuctl, monkeypatch):
    assert gpuctl("datasets", "create", "vision", "Bad Name").exit_code == 2
    bad = gpuctl("datasets", "create", "vision", "ok", "--url", "ftp://x/y")
    assert bad.exit_code == 2 and "source.url" in bad.stderr
    dataset = json.loads(gpuctl("datasets", "create", "vision", "mine", "-o", "json").stdout)
    nosource = gpuctl("datasets", "add-version", dataset["id"])
    assert nosource.exit_code == 2 and "--url or --s3-bucket" in nosource.stderr
    refused = gpuctl("submit", "-p", "vision", "--image", "gpuportal/busybox:latest", "-d", "mine", "--", "true")
    assert refused.exit_code == 2 and "no ready version" in refused.stderr
    monkeypatch.setenv("GPUCTL_TOKEN", portal.token["charlie"])
    outsider = gpuctl("datasets", "show", dataset["id"])
    assert outsider.exit_code == 4 and f"dataset {dataset['id']} not found" in outsider.stderr
