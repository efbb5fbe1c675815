"""build.py builds llama.cpp for the CPU it runs on: the instruction sets from /proc/cpuinfo's flags (or
RIDGEFILL_LLAMACPP_CPU), never AMX or GGML_NATIVE, and the features in the cache key; the driver refuses a build
that needs an instruction set the running CPU lacks (whole messages). The wheel is keyed by the library patch, the
server by all three patches; each patch applies cleanly, in order, to the pinned source."""

from __future__ import annotations

import subprocess
import tarfile

import pytest

from ridgefill.backends.llamacpp import build, library
from ridgefill.errors import RidgefillError

# the flags lines of two CPUs: a desktop without AVX-512 (what `qemu-x86_64 -cpu max` emulates) and an AVX-512 server
DESKTOP = ("fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat sse sse2 ht syscall nx lm pni pclmulqdq "
           "ssse3 fma cx16 sse4_1 sse4_2 movbe popcnt aes xsave avx f16c rdrand bmi1 avx2 bmi2 adx")
SERVER = DESKTOP + (" avx512f avx512dq avx512cd avx512bw avx512vl avx512vbmi avx512_vnni avx512_bf16 amx_tile "
                    "amx_int8 amx_bf16 avx_vnni")


def cpuinfo(tmp_path, flags: str, name: str = "cpuinfo"):
    """A /proc/cpuinfo of two processors with these flags."""
    block = f"processor\t: {{n}}\nvendor_id\t: GenuineIntel\nmodel name\t: Test CPU\nflags\t\t: {flags}\n\n"
    path = tmp_path / name
    path.write_text(block.format(n=0) + block.format(n=1))
    return path


def test_features_of_a_cpu_without_avx512(tmp_path, monkeypatch):
    monkeypatch.delenv(build.CPU_ENV, raising=False)
    feats = build.features(build.cpu_flags(cpuinfo(tmp_path, DESKTOP)))
    assert feats == ("sse4_2", "avx", "avx2", "bmi2", "fma", "f16c")
    flags = build.cmake_flags(feats).split()
    assert "-DGGML_NATIVE=OFF" in flags and "-DGGML_AVX2=ON" in flags and "-DGGML_FMA=ON" in flags
    assert "-DGGML_AVX512=OFF" in flags and "-DGGML_AVX512_VNNI=OFF" in flags and "-DGGML_AVX_VNNI=OFF" in flags
    assert {"-DGGML_AMX_INT8=OFF", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_BF16=OFF"} <= set(flags)


def test_features_of_an_avx512_cpu_never_take_amx(tmp_path, monkeypatch):
    monkeypatch.delenv(build.CPU_ENV, raising=False)
    feats = build.features(build.cpu_flags(cpuinfo(tmp_path, SERVER)))
    assert feats == ("sse4_2", "avx", "avx2", "bmi2", "fma", "f16c", "avx_vnni", "avx512f", "avx512cd", "avx512vl",
                     "avx512dq", "avx512bw", "avx512vbmi", "avx512_vnni", "avx512_bf16")
    flags = build.cmake_flags(feats).split()
    assert "-DGGML_AVX512=ON" in flags and "-DGGML_AVX512_BF16=ON" in flags and "-DGGML_AVX_VNNI=ON" in flags
    assert not [f for f in flags if f.startswith("-DGGML_AMX") and not f.endswith("=OFF")]


def test_an_avx512_extension_without_the_base_set_is_not_used(tmp_path, monkeypatch):
    """GGML_AVX512 compiles with -mavx512f/cd/vl/dq/bw: a CPU lacking one of them gets no AVX-512 at all."""
    monkeypatch.delenv(build.CPU_ENV, raising=False)
    feats = build.features(build.cpu_flags(cpuinfo(tmp_path, DESKTOP + " avx512f avx512_vnni")))
    assert feats == ("sse4_2", "avx", "avx2", "bmi2", "fma", "f16c")


def test_the_features_key_the_wheel(tmp_path, monkeypatch):
    monkeypatch.delenv(build.CPU_ENV, raising=False)
    desktop = build.features(build.cpu_flags(cpuinfo(tmp_path, DESKTOP, "a")))
    server = build.features(build.cpu_flags(cpuinfo(tmp_path, SERVER, "b")))
    assert build.build_key(feats=desktop) != build.build_key(feats=server)
    assert build.build_key(patched=False, feats=desktop) != build.build_key(patched=False, feats=server)
    assert build.build_key(feats=desktop) != build.build_key(patched=False, feats=desktop)
    monkeypatch.setenv(build.CPUINFO_ENV, str(cpuinfo(tmp_path, DESKTOP, "c")))  # what --key and the stamp read
    assert build.build_key() == build.build_key(feats=desktop)


def test_building_for_another_cpu(monkeypatch):
    monkeypatch.setenv(build.CPU_ENV, "avx, avx2,fma f16c")
    assert build.features() == ("avx", "avx2", "fma", "f16c")
    monkeypatch.setenv(build.CPU_ENV, "")
    assert build.features() == () and "-DGGML_AVX=OFF" in build.cmake_flags().split()
    monkeypatch.setenv(build.CPU_ENV, "avx2,amx_int8,avx9")
    with pytest.raises(SystemExit) as err:
        build.features()
    assert str(err.value) == (f"{build.CPU_ENV} names amx_int8, avx9, not an instruction set this build chooses: use "
                              f"/proc/cpuinfo flag names among {', '.join(build.KNOWN)}")


def test_a_build_for_instruction_sets_this_cpu_lacks_is_one_line():
    library.check_cpu(("avx", "avx2"), ("sse4_2", "avx", "avx2", "fma"))
    with pytest.raises(RidgefillError) as err:
        library.check_cpu(("avx", "avx2", "avx512f", "avx512bw"), ("sse4_2", "avx", "avx2", "fma"))
    assert str(err.value) == ("the installed llama-cpp-python was built for a CPU with avx512f, avx512bw, which this "
                              "CPU lacks: run `make install` (it builds llama.cpp for the CPU it runs on)")


def test_the_wheel_is_keyed_by_the_library_patch_and_the_server_by_all_three(tmp_path, monkeypatch):
    """Another server or common patch builds another llama-server and the same wheel; another library patch builds
    both again; the Makefile's stamp (--key) names both keys."""
    monkeypatch.delenv(build.CPU_ENV, raising=False)
    feats = build.features(build.cpu_flags(cpuinfo(tmp_path, DESKTOP)))
    wheel, server = build.build_key(feats=feats), build.server_key(feats=feats)
    assert build.LIBRARY_PATCH == build.SERVER_PATCHES[0] and library.PATCH == build.LIBRARY_PATCH
    for name in ("server.patch", "common.patch", "libllama.patch"):
        copy = tmp_path / "patches" / name
        copy.parent.mkdir(exist_ok=True)
        copy.write_bytes((build.PATCHES / name).read_bytes() + b"\n")
        patches = tuple(copy if p.name == name else p for p in build.SERVER_PATCHES)
        monkeypatch.setattr(build, "SERVER_PATCHES", patches)
        monkeypatch.setattr(build, "LIBRARY_PATCH", patches[0])
        assert build.server_key(feats=feats) != server, name
        assert (build.build_key(feats=feats) != wheel) == (name == "libllama.patch"), name
        monkeypatch.undo()
        monkeypatch.delenv(build.CPU_ENV, raising=False)
    assert build.server_key(patched=False, feats=feats) != server
    assert build.install_key() == f"{build.build_key()}-{build.server_key()}"


def test_the_patches_apply_cleanly_in_order_to_the_pinned_source(tmp_path):
    source = build.cache_root() / "sdist" / f"llama_cpp_python-{build.VERSION}.tar.gz"
    if not source.is_file():
        pytest.skip(f"no sdist of llama-cpp-python {build.VERSION} in the cache (make install downloads it)")
    prefix = f"llama_cpp_python-{build.VERSION}/vendor/llama.cpp/"
    touched = {line.split()[1].removeprefix("b/") for p in build.SERVER_PATCHES
               for line in p.read_text().splitlines() if line.startswith("+++ ") and line.split()[1] != "/dev/null"}
    with tarfile.open(source) as tar:
        members = [m for m in tar.getmembers() if m.name.removeprefix(prefix) in touched]
        tar.extractall(tmp_path, members=members, filter="data")
    root = tmp_path / prefix
    for patch in build.SERVER_PATCHES:
        done = subprocess.run(["patch", "-p1", "--forward", "--batch", "-i", str(patch)], cwd=root,
                              capture_output=True, text=True)
        assert done.returncode == 0 and "fuzz" not in done.stdout and "offset" not in done.stdout, (patch.name,
                                                                                                    done.stdout)
