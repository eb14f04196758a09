#!/usr/bin/env python3
"""duet as installed: libduet.so exports exactly the functions core/duet.h
declares, and a staged `cmake --install` works the way a user would use it:
the README's embedding example, copied out of README.md, compiles as written
with `cc example.c $(pkg-config --cflags --libs duet)` and runs on
stories260K; it links against libduet.a with the README's static line and
prints the same text; find_package(duet) gives duet::duet; the installed
`duet` starts on the installed library.

usage: test_install.py DUET_BINARY SHARED_DIR BUILD_DIR
"""
import os
import re
import shutil
import subprocess
import sys
import tempfile
import unittest

DUET, SHARED, BUILD = sys.argv[1], sys.argv[2], sys.argv[3]
SOURCE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEADER = os.path.join(SOURCE, "core", "duet.h")
STORIES = os.path.join(SHARED, "models", "stories260K.gguf")
# The README's build line for the example, run as written.
README_CC = "cc example.c $(pkg-config --cflags --libs duet)"
README_CC_STATIC = ("cc example.c $(pkg-config --cflags duet) -l:libduet.a -Wl,--as-needed "
                    "$(pkg-config --static --libs duet)")


def run(cmd, **kw):
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, **kw)
    if p.returncode != 0:
        shown = cmd if isinstance(cmd, str) else " ".join(cmd)
        raise AssertionError(f"{shown} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    return p.stdout


def cache_value(name):
    with open(os.path.join(BUILD, "CMakeCache.txt")) as f:
        for line in f:
            if line.startswith(name + ":"):
                return line.split("=", 1)[1].strip()
    return ""


SANITIZED = cache_value("DUET_SANITIZE").upper() in ("ON", "1", "TRUE", "YES")
# A sanitized libduet needs its runtime in the program too.
SAN_FLAGS = " -fsanitize=address,undefined" if SANITIZED else ""


def header_functions():
    """Names of the functions core/duet.h declares (after the preprocessor)."""
    text = run(["cc", "-E", "-P", HEADER])
    # A declaration is `name(`; a function pointer type is `(*name)(`.
    return {m.group(1) for m in re.finditer(r"\b(duet_\w+)\s*\(", text)}


def header_version():
    with open(HEADER) as f:
        text = f.read()
    return tuple(int(re.search(rf"#define DUET_VERSION_{p} (\d+)", text).group(1)) for p in ("MAJOR", "MINOR", "PATCH"))


def readme_example():
    with open(os.path.join(SOURCE, "README.md")) as f:
        text = f.read()
    section = text[text.index("## Embed it"):]
    return re.search(r"```c\n(.*?)```", section, re.S).group(1), section


# Symbols every shared object defines (the linker's), and what the
# sanitizers' instrumentation adds; nothing else may be exported.
LINKER_SYMBOLS = {"_init", "_fini", "_edata", "_end", "__bss_start"}
SANITIZER_PREFIXES = ("__asan", "__odr_asan", "__ubsan", "__sanitizer", "__sancov", "__lsan")


class Exports(unittest.TestCase):
    def test_exported_symbols_are_the_header(self):
        lib = os.path.join(BUILD, "libduet.so")
        out = run(["nm", "-D", "--defined-only", lib])
        exported = set()
        for line in out.splitlines():
            name = line.split()[-1].split("@")[0]
            if name in LINKER_SYMBOLS or name.startswith(SANITIZER_PREFIXES):
                continue
            exported.add(name)
        declared = header_functions()
        self.assertGreater(len(declared), 30)
        self.assertEqual(sorted(exported - declared), [], "exported but not declared in duet.h")
        self.assertEqual(sorted(declared - exported), [], "declared in duet.h but not exported")

    def test_soname_follows_the_version(self):
        major, minor, patch = header_version()
        soversion = f"0.{minor}" if major == 0 else str(major)
        dyn = run(["readelf", "-d", os.path.join(BUILD, "libduet.so")])
        self.assertIn(f"[libduet.so.{soversion}]", dyn)
        self.assertTrue(os.path.isfile(os.path.join(BUILD, f"libduet.so.{major}.{minor}.{patch}")))

    def test_version(self):
        out = run([DUET, "--version"])
        version = ".".join(map(str, header_version()))
        self.assertRegex(out, rf"^duet {re.escape(version)}\nbackends: cpu( \w+)*\n$")
        for gpu in ("vulkan", "opencl"):
            if os.environ.get("DUET_REQUIRE_BACKENDS", "").find(gpu) >= 0:
                self.assertIn(gpu, out.split("backends:")[1].split())


class StagedInstall(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.work = os.path.join(BUILD, "test_install")
        shutil.rmtree(cls.work, ignore_errors=True)
        cls.prefix = os.path.join(cls.work, "prefix")
        run(["cmake", "--install", BUILD, "--prefix", cls.prefix])
        libdir = cache_value("CMAKE_INSTALL_LIBDIR") or "lib"
        cls.libdir = os.path.join(cls.prefix, libdir)
        cls.env = dict(os.environ, PKG_CONFIG_PATH=os.path.join(cls.libdir, "pkgconfig"))
        # The example opens "model.gguf" in its working folder.
        cls.run_dir = os.path.join(cls.work, "run")
        os.makedirs(cls.run_dir)
        os.symlink(STORIES, os.path.join(cls.run_dir, "model.gguf"))
        cls.example, cls.section = readme_example()

    def run_example(self, exe, env=None):
        return run([exe], cwd=self.run_dir, env=env)

    def test_layout(self):
        p, l = self.prefix, self.libdir
        for f in ("bin/duet", "bin/duet-bench", "include/duet.h"):
            self.assertTrue(os.path.isfile(os.path.join(p, f)), f)
        for f in ("libduet.a", "libduet.so", "pkgconfig/duet.pc", "cmake/duet/duetConfig.cmake",
                  "cmake/duet/duetConfigVersion.cmake", "cmake/duet/duetTargets.cmake"):
            self.assertTrue(os.path.exists(os.path.join(l, f)), f)
        self.assertTrue(os.path.islink(os.path.join(l, "libduet.so")))
        with open(os.path.join(l, "pkgconfig", "duet.pc")) as f:
            self.assertIn(f"prefix={p}\n", f.read())
        # The installed program runs on the installed library: found through
        # its run path (bin/../lib), except for a build configured for /usr,
        # whose programs have none (the system's linker finds /usr/lib).
        exe = os.path.join(p, "bin", "duet")
        env = None
        if cache_value("CMAKE_INSTALL_PREFIX") == "/usr":
            env = dict(os.environ, LD_LIBRARY_PATH=l)
        found = re.search(r"libduet\.so\S* => (\S+)", run(["ldd", exe], env=env)).group(1)
        self.assertEqual(os.path.dirname(os.path.realpath(found)), os.path.realpath(l))
        self.assertTrue(run([exe, "--version"], env=env).startswith("duet "))

    def test_readme_example_as_written(self):
        self.assertIn("    " + README_CC + "\n", self.section, "the README's build line changed")
        d = os.path.join(self.work, "readme")
        os.makedirs(d)
        with open(os.path.join(d, "example.c"), "w") as f:
            f.write(self.example)
        run(README_CC + " -Werror=implicit-function-declaration" + SAN_FLAGS, shell=True, cwd=d, env=self.env)
        exe = os.path.join(d, "a.out")
        self.assertIn("libduet.so", run(["readelf", "-d", exe]))
        shared_out = self.run_example(exe, env=dict(os.environ, LD_LIBRARY_PATH=self.libdir))
        self.assertGreater(len(shared_out.strip()), 20, shared_out)

        # Static, as the README says: libduet.a and duet.pc's private
        # dependencies; the same text.
        self.assertIn("    " + README_CC_STATIC + "\n", self.section, "the README's static build line changed")
        run(README_CC_STATIC + " -o example-static" + SAN_FLAGS, shell=True, cwd=d, env=self.env)
        static = os.path.join(d, "example-static")
        self.assertNotIn("libduet", run(["readelf", "-d", static]))
        self.assertEqual(self.run_example(static), shared_out)

    def test_find_package(self):
        d = os.path.join(self.work, "cmake")
        os.makedirs(d)
        with open(os.path.join(d, "example.c"), "w") as f:
            f.write(self.example)
        major, minor, _ = header_version()
        with open(os.path.join(d, "CMakeLists.txt"), "w") as f:
            f.write("cmake_minimum_required(VERSION 3.25)\nproject(example C)\n"
                    f"find_package(duet {major}.{minor} REQUIRED)\n"
                    "add_executable(example example.c)\n"
                    "target_link_libraries(example PRIVATE duet::duet)\n")
        cfg = ["cmake", "-S", d, "-B", os.path.join(d, "build"), f"-DCMAKE_PREFIX_PATH={self.prefix}"]
        if SANITIZED:
            cfg.append("-DCMAKE_C_FLAGS=" + SAN_FLAGS.strip())
        run(cfg)
        run(["cmake", "--build", os.path.join(d, "build")])
        # Linked with the library's path as its run path: no LD_LIBRARY_PATH.
        out = self.run_example(os.path.join(d, "build", "example"))
        self.assertGreater(len(out.strip()), 20, out)


if __name__ == "__main__":
    unittest.main(argv=[sys.argv[0], "-v"])
