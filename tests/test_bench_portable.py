"""What a bench's result file records of a path: nothing that names this machine."""
from bench import REPO, SCRATCH_DIR, portable


def test_result_paths_name_no_scratch_folder_or_absolute_path(tmp_path):
    folder = SCRATCH_DIR / "test_portable" / "drafter"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.safetensors").write_bytes(b"weights")
    try:
        rel = str(folder.relative_to(REPO))
        for given in (rel, str(folder)):
            out = portable(given)
            assert out["folder"] == "drafter" and len(out["sha256"]) == 64, out
        assert portable(str(REPO / "README.md")) == "README.md"
        assert portable("README.md") == "README.md"
        assert portable(str(tmp_path / "x.parquet")) == "x.parquet"
        for value in ("eagle3", "1,2,4", "", 3):
            assert portable(value) == value
    finally:
        (folder / "model.safetensors").unlink()
        folder.rmdir()
        folder.parent.rmdir()
