"""Memory limits checked on what a file declares, before anything of that size is allocated."""
import pytest

from mlflow_di import input_files
from mlflow_di.errors import UserError


@pytest.mark.parametrize("size, shown", [(0, "0 bytes"), (3136, "3,136 bytes"), (2**20, "1.0 MiB"),
                                         (int(1.5 * 2**30), "1.5 GiB"), (150_000_000 * 8, "1.1 GiB")])
def test_amounts_read_as_people_read_them(size, shown):
    assert input_files.amount(size) == shown


def test_the_array_limit_is_one_gib_unless_the_environment_says_otherwise(monkeypatch):
    monkeypatch.delenv("MLFLOW_DI_MAX_ARRAY_BYTES", raising=False)
    assert input_files.array_limit() == 2**30
    monkeypatch.setenv("MLFLOW_DI_MAX_ARRAY_BYTES", "4_000_000_000")
    assert input_files.array_limit() == 4_000_000_000
    for bad in ("x", "0", "-5", "1e9"):
        monkeypatch.setenv("MLFLOW_DI_MAX_ARRAY_BYTES", bad)
        with pytest.raises(UserError, match="MLFLOW_DI_MAX_ARRAY_BYTES must be a positive whole number"):
            input_files.array_limit()


def test_an_allocation_above_the_limit_or_half_the_memory_is_refused_naming_it(monkeypatch):
    monkeypatch.setenv("MLFLOW_DI_MAX_ARRAY_BYTES", "1000")
    input_files.check_allocation("array 'x'", 1000, "split it")  # at the limit: fine
    with pytest.raises(UserError, match=r"^array 'x' would take 1,001 bytes, more than the 1,000 bytes one array "
                                        r"may \(MLFLOW_DI_MAX_ARRAY_BYTES\); split it$"):
        input_files.check_allocation("array 'x'", 1001, "split it")
    monkeypatch.setenv("MLFLOW_DI_MAX_ARRAY_BYTES", str(2**40))
    monkeypatch.setattr(input_files, "available_memory", lambda: 8 * 2**30)
    input_files.check_allocation("array 'x'", 4 * 2**30, "split it")
    with pytest.raises(UserError, match=r"more than half of the 8.0 GiB of memory available; split it$"):
        input_files.check_allocation("array 'x'", 4 * 2**30 + 1, "split it")
    monkeypatch.setattr(input_files, "available_memory", lambda: None)  # unknown: only the limit holds
    input_files.check_memory("archive", 2**50, "check it")


def test_a_pt2_archive_that_unpacks_beyond_memory_is_refused_before_torch_reads_it(tmp_path, monkeypatch):
    import zipfile

    from mlflow_di.models.pt2 import load_pt2

    archive = tmp_path / "model.pt2"
    with zipfile.ZipFile(archive, "w", compression=zipfile.ZIP_DEFLATED) as bomb:
        bomb.writestr("model/data/weights/w0", bytes(8 * 2**20))  # 8 MiB of zeros, a few KB on disk
    monkeypatch.setattr(input_files, "available_memory", lambda: 4 * 2**20)
    with pytest.raises(UserError, match=r"the pt2 \(torch.export\) model 'm' \(its largest member 'model/data/weights/w0' "
                                        r"unpacks to 8.0 MiB\) would take 8.0 MiB, more than half of the 4.0 MiB"):
        load_pt2(archive, "m")
