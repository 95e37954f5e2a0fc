"""The wheel is the distribution a container image installs: it must hold every module, the generated gRPC
stubs and the decode kernel's C source, and work with the source tree out of sight.

The wheel is built and installed by the Dockerfile's own commands (conftest.py: `image_install`) from a copy of
the checkout without generated files (as a clean clone has it), into a fresh virtualenv outside the source tree,
and exercised there with the image's environment. Third-party packages come from the project's own virtualenv
through a path entry (reinstalling torch and the rest would take minutes); the project's editable install is not
visible there, so every `flotilla` module must come from the wheel.
"""

from __future__ import annotations

import textwrap

# Run in the fresh virtualenv: imports every module the wheel lists, from the wheel's files only.
CHECK_INSTALLED = textwrap.dedent("""
    import importlib, importlib.metadata, sys
    from pathlib import Path

    site = Path(sys.argv[1]).resolve()
    files = [f for f in importlib.metadata.files("flotilla") if f.suffix == ".py"]
    modules = sorted(".".join(f.with_suffix("").parts).removesuffix(".__init__") for f in files
                     if f.parts[0] == "flotilla" and f.name != "__main__.py")
    # kopf's entry module registers its handlers, and so connects to a cluster, when imported: listed only.
    entry_modules = {"flotilla.operator.main"}
    for name in modules:
        if name in entry_modules:
            continue
        module = importlib.import_module(name)
        assert Path(module.__file__).resolve().is_relative_to(site), f"{name} imported from {module.__file__}"
    for expected in ("flotilla.api.worker.v1.worker_pb2_grpc", "flotilla.autoscaling.control",
                     "flotilla.autoscaler.supervisor", "flotilla.operator.handlers", "flotilla.cli",
                     *entry_modules):
        assert expected in modules, f"{expected} is not in the wheel"

    import torch
    from flotilla.engine.model import decode_kernel, prefill_kernel
    from flotilla.engine.model.attention import AttentionMetadata, SeqChunk, paged_attention
    from flotilla.engine.model.kv_cache import layer_shape

    assert decode_kernel.SOURCE.resolve().is_relative_to(site), decode_kernel.SOURCE
    assert decode_kernel.load() is not None, "the decode kernel did not build from the installed source"
    assert prefill_kernel.SOURCE.resolve().is_relative_to(site), prefill_kernel.SOURCE
    assert prefill_kernel.load() is not None, "the prefill kernel did not build from the installed source"
    torch.manual_seed(0)
    kv_cache = torch.randn(layer_shape(16, 4, 2, 16))
    seqs = [SeqChunk(9, 1, [3, 7, 1]), SeqChunk(0, 1, [5]), SeqChunk(13, 1, [0, 2, 9, 11])]
    q, k, v = torch.randn(3, 4, 16), torch.randn(3, 2, 16), torch.randn(3, 2, 16)
    results = []
    for use_kernel in (False, True):
        meta = AttentionMetadata.build(seqs, 4, torch.device("cpu"), use_decode_kernel=use_kernel)
        assert (meta.decode_rows is not None) == use_kernel
        results.append(paged_attention(q, k, v, kv_cache.clone(), meta))
    torch.testing.assert_close(results[1], results[0], atol=1e-5, rtol=1e-5)
    print(f"imported {len(modules)} modules; decode kernel built and agrees with the torch path")
""")


def test_every_module_imports_from_the_wheel_and_the_kernel_builds(image_install, tmp_path):
    python = str(image_install.python)
    site = image_install.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp_path)
    check = tmp_path / "check_installed.py"
    check.write_text(CHECK_INSTALLED)
    result = image_install.run([python, str(check), site.stdout.strip()], tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "decode kernel built" in result.stdout
    # Built from the installed source into the image's FLOTILLA_CACHE (a writable volume in the chart).
    assert list((image_install.cache / "kernels").glob("paged_decode_attention-*.so"))


def test_console_script_runs_from_the_wheel(image_install, tmp_path):
    result = image_install.run([str(image_install.prefix / "bin" / "flotilla"), "--help"], tmp_path)
    assert result.returncode == 0, result.stderr
    for subcommand in ("up", "gateway", "worker", "router", "keys", "model"):
        assert subcommand in result.stdout
