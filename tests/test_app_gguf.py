"""GGUF files in the app: the Models tab lists them (LM Studio's and llama.cpp's folders, added folders, the hub
cache) with architecture, quant, size, context and the planner's verdict; damaged or unservable files say why; the
Engine tab takes a .gguf path; a repo id whose repo holds GGUF files offers them and downloads only the chosen
one."""
import qt_helpers  # noqa: F401  (offscreen Qt, private data dir)

import shutil

import gguf
import numpy as np
import pytest
from gguf_files import make_tiny_gguf

import app.hf_cache as hf_cache
from app.hf_cache import RepoGguf, gguf_files_of
from app.model_library import FITS_COLUMN, ModelLibrary, scan_library
from app.model_picker import ModelPicker
from app.settings import default_values
from engine.config.model_discovery import GgufRoot, gguf_roots


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return make_tiny_gguf(tmp_path_factory.mktemp("gguf"), "qwen2", "Q8_0")


def test_default_roots_are_lm_studios_and_llama_cpps(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("LLAMA_CACHE", str(tmp_path / "llama-cache"))
    assert gguf_roots() == []
    (tmp_path / ".lmstudio" / "models").mkdir(parents=True)
    (tmp_path / "llama-cache").mkdir()
    assert gguf_roots() == [GgufRoot(tmp_path / ".lmstudio" / "models", "LM Studio"),
                            GgufRoot(tmp_path / "llama-cache", "llama.cpp")]


def test_library_lists_gguf_files_with_their_description(qtbot, tmp_path, tiny_gguf):
    studio = tmp_path / "lmstudio" / "lmstudio-community" / "Tiny-GGUF"
    studio.mkdir(parents=True)
    shutil.copy(tiny_gguf, studio / "tiny-Q8_0.gguf")
    (studio / "mmproj-tiny-F16.gguf").write_bytes(b"GGUF")  # a vision projector: not a model
    added = tmp_path / "models"
    added.mkdir()
    first = make_tiny_gguf(tmp_path, "qwen2", "Q8_0", split_max_tensors=10, file_name="split.gguf")
    for part in tmp_path.glob("split-*.gguf"):
        part.rename(added / part.name)
    first = added / first.name
    entries = scan_library([added], cache_dir=tmp_path / "no-cache", gguf_roots=[GgufRoot(tmp_path / "lmstudio",
                                                                                           "LM Studio")])
    by_name = {e.name: e for e in entries}
    assert set(by_name) == {"tiny-Q8_0", first.stem}  # a split set once, by its first part
    e = by_name["tiny-Q8_0"]
    assert e.source == "GGUF (LM Studio)" and e.size_bytes == tiny_gguf.stat().st_size
    assert e.info.architecture == "Qwen2ForCausalLM" and e.info.context_length == 512
    assert e.info.quantization.startswith("Q8_0 (Q8_0 9")  # llama.cpp's file type, then each type's share
    assert by_name[first.stem].size_bytes == sum(p.stat().st_size for p in added.glob("split-*.gguf"))

    library = ModelLibrary()
    qtbot.addWidget(library)
    library.entries = entries
    library.set_machine(default_values(0), [])
    row = [library.table.item(r, 0).text() for r in range(library.table.rowCount())].index("tiny-Q8_0")
    cells = [library.table.item(row, c).text() for c in range(library.table.columnCount())]
    assert cells[1:4] == ["GGUF (LM Studio)", cells[2], "Qwen2ForCausalLM"] and cells[6] == "512"
    assert cells[FITS_COLUMN].startswith("✔ CPU")
    library.table.selectRow(row)
    with qtbot.waitSignal(library.model_chosen) as chosen:
        library.use_button.click()
    assert chosen.args[0].endswith("tiny-Q8_0.gguf")


def _with_q2_k(path):
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("token_embd.weight", np.zeros((4, 84), dtype=np.uint8), raw_dtype=gguf.GGMLQuantizationType.Q2_K)
    w.write_header_to_file(path=path)
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_unservable_and_damaged_files_say_why(qtbot, tmp_path, tiny_gguf):
    root = tmp_path / "models"
    root.mkdir()
    _with_q2_k(root / "old-Q2_K.gguf")
    (root / "cut.gguf").write_bytes(tiny_gguf.read_bytes()[:-500])
    entries = {e.name: e for e in scan_library([root], cache_dir=tmp_path / "no-cache")}
    assert entries["old-Q2_K"].unsupported == "not supported: Q2_K tensors"
    assert entries["cut"].info is None and "truncated" in entries["cut"].problem
    library = ModelLibrary()
    qtbot.addWidget(library)
    library.entries = list(entries.values())
    library.set_machine(default_values(0), [])
    verdicts = {library.table.item(r, 0).text(): library.table.item(r, FITS_COLUMN).text()
                for r in range(library.table.rowCount())}
    assert verdicts["old-Q2_K"] == "✘ not supported: Q2_K tensors"
    assert verdicts["cut"].startswith("✘ unreadable: cut.gguf is truncated")
    library.table.selectRow(list(verdicts).index("old-Q2_K"))
    assert not library.use_button.isEnabled()


def test_the_picker_takes_a_gguf_file(qtbot, tiny_gguf):
    picker = ModelPicker()
    qtbot.addWidget(picker)
    with qtbot.waitSignal(picker.model_changed):
        assert picker.set_model_path(str(tiny_gguf))
    assert picker.details.text().startswith("Qwen2ForCausalLM · ") and "Q8_0" in picker.details.text()


def test_gguf_files_of_a_repo_by_quant_and_size():
    files = gguf_files_of([("Qwen3-8B-Q4_K_M.gguf", 5_000), ("Qwen3-8B-IQ4_XS.gguf", 4_500), ("mmproj-F16.gguf", 9),
                           ("UD/Big-UD-Q4_K_XL-00002-of-00002.gguf", 10), ("UD/Big-UD-Q4_K_XL-00001-of-00002.gguf", 10),
                           ("README.md", 1)])
    assert [(f.quant, f.size, f.parts) for f in files] == [
        ("UD-Q4_K_XL", 20, ("UD/Big-UD-Q4_K_XL-00001-of-00002.gguf", "UD/Big-UD-Q4_K_XL-00002-of-00002.gguf")),
        ("IQ4_XS", 4_500, ("Qwen3-8B-IQ4_XS.gguf",)), ("Q4_K_M", 5_000, ("Qwen3-8B-Q4_K_M.gguf",))]


def test_download_by_repo_id_offers_the_repos_gguf_files(qtbot, tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE")
    offered = [RepoGguf("m-IQ4_XS.gguf", ("m-IQ4_XS.gguf",), 4 * 2**30, "IQ4_XS"),
               RepoGguf("m-Q4_K_M.gguf", ("m-Q4_K_M.gguf",), 5 * 2**30, "Q4_K_M")]
    monkeypatch.setattr(hf_cache, "list_repo_gguf", lambda repo_id: offered)
    asked = []

    def snapshot_download(repo_id, **kwargs):
        asked.append((repo_id, kwargs["allow_patterns"]))
        return str(tmp_path / "snapshot")

    monkeypatch.setattr("huggingface_hub.snapshot_download", snapshot_download)
    picker = ModelPicker()
    qtbot.addWidget(picker)
    picker.repo_edit.setText("someone/M-GGUF")
    picker.download_button.click()
    qtbot.waitUntil(lambda: picker.gguf_combo.count() == 2, timeout=10_000)
    assert picker.gguf_combo.isVisible() or not picker.isVisible()
    assert [picker.gguf_combo.itemText(i) for i in range(2)] == ["IQ4_XS · 4.00 GiB · m-IQ4_XS.gguf",
                                                                 "Q4_K_M · 5.00 GiB · m-Q4_K_M.gguf"]
    assert "holds 2 GGUF files" in picker.details.text() and not asked
    picker.gguf_combo.setCurrentIndex(1)
    with qtbot.waitSignal(picker.download_ended, timeout=10_000):
        picker.download_button.click()
    assert asked == [("someone/M-GGUF", ["m-Q4_K_M.gguf"])]
    assert picker.path_edit.text() == str(tmp_path / "snapshot" / "m-Q4_K_M.gguf")
    picker.repo_edit.setText("someone/other")  # another repo: the list is asked again
    assert picker.gguf_combo.count() == 0
