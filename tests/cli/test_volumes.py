"""gpuctl volumes create, list, put, ls and get against a live portal."""
import json


def test_a_file_goes_in_and_comes_back(portal, gpuctl, tmp_path, monkeypatch):
    created = gpuctl("volumes", "create", "vision", "data", "--quota-mb", "5", "-o", "json")
    assert created.exit_code == 0, created.stderr
    volume = json.loads(created.stdout)
    listed = gpuctl("volumes", "list", "--project", "vision")
    assert listed.exit_code == 0 and "data" in listed.stdout and "/data/data" in listed.stdout
    source = tmp_path / "train.csv"
    source.write_bytes(b"a,b\n1,2\n")
    put = gpuctl("volumes", "put", volume["id"], source, "inputs/train.csv")
    assert put.exit_code == 0, put.stderr
    assert "Uploaded 8 bytes to inputs/train.csv" in put.stdout
    ls = gpuctl("volumes", "ls", volume["id"], "inputs")
    assert ls.exit_code == 0 and "train.csv" in ls.stdout and "8" in ls.stdout
    monkeypatch.chdir(tmp_path)
    got = gpuctl("volumes", "get", volume["id"], "inputs/train.csv", "-O", "copy.csv")
    assert got.exit_code == 0, got.stderr
    assert (tmp_path / "copy.csv").read_bytes() == b"a,b\n1,2\n"


def test_errors_name_the_field_and_exit_like_the_api(portal, gpuctl, monkeypatch, tmp_path):
    volume = json.loads(gpuctl("volumes", "create", "vision", "data", "-o", "json").stdout)
    bad = gpuctl("volumes", "ls", volume["id"], "../x")
    assert bad.exit_code == 2 and "path:" in bad.stderr
    missing = gpuctl("volumes", "get", volume["id"], "nope.txt", "-O", str(tmp_path / "nope"))
    assert missing.exit_code == 4 and "No such file" in missing.stderr
    assert not (tmp_path / "nope").exists() and not (tmp_path / "nope.part").exists()
    monkeypatch.setenv("GPUCTL_TOKEN", portal.token["charlie"])
    outsider = gpuctl("volumes", "ls", volume["id"])
    assert outsider.exit_code == 4 and f"volume {volume['id']} not found" in outsider.stderr
    assert gpuctl("volumes", "create", "vision", "x").exit_code == 2  # vision does not exist for charlie
