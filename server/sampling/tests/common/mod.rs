//! Test support: locating the plugin libraries cargo built for this test
//! run and compiling the C example plugins with the system C compiler.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

/// `target/<profile>/`, where cargo puts the workspace's cdylibs.
pub fn target_profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    // target/<profile>/deps/<test-binary>
    exe.parent()
        .and_then(Path::parent)
        .expect("test binary lives in target/<profile>/deps")
        .to_path_buf()
}

/// The cdylib cargo built for this test run. `deps/` first: cargo refreshes
/// a dev-dependency's cdylib there, while the copy in `target/<profile>/`
/// is only updated by a build of that package and may be stale.
fn cdylib(name: &str) -> PathBuf {
    let file = format!("lib{name}.{}", std::env::consts::DLL_EXTENSION);
    let dir = target_profile_dir();
    [dir.join("deps").join(&file), dir.join(&file)]
        .into_iter()
        .find(|p| p.exists())
        .unwrap_or_else(|| {
            panic!(
                "{file} was not built (looked in {} and deps/)",
                dir.display()
            )
        })
}

pub fn core_plugin() -> PathBuf {
    cdylib("samplerd_core_stages")
}

pub fn test_plugin() -> PathBuf {
    cdylib("samplerd_test_plugins")
}

pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// A scratch directory unique to this test process and `name`.
pub fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("samplerd-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Compiles `plugins/examples/<src>` into `<out_dir>/<lib>.so` with `defines`.
pub fn build_c_plugin(src: &str, out_dir: &Path, lib: &str, defines: &[&str]) -> PathBuf {
    let root = repo_root();
    let out = out_dir.join(format!("lib{lib}.{}", std::env::consts::DLL_EXTENSION));
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let mut cmd = Command::new(&cc);
    cmd.args([
        "-std=c11", "-O2", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC", "-I",
    ])
    .arg(root.join("plugins/sdk/include"));
    for d in defines {
        cmd.arg(format!("-D{d}"));
    }
    cmd.arg(root.join("plugins/examples").join(src))
        .arg("-o")
        .arg(&out);
    let status = cmd
        .status()
        .unwrap_or_else(|e| panic!("cannot run C compiler {cc:?}: {e}"));
    assert!(status.success(), "compiling {src} failed");
    out
}
