//! Embeds every file under `assets/` (the dashboard) into the binary, so that serving it needs no files on disk
//! and building needs no Node.

use std::path::{Path, PathBuf};

fn walk(dir: &Path, base: &Path, out: &mut Vec<(String, PathBuf)>) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    let mut entries: Vec<_> = entries.flatten().collect();
    entries.sort_by_key(|e| e.file_name());
    for e in entries {
        let p = e.path();
        if p.is_dir() {
            walk(&p, base, out);
        } else if let Ok(rel) = p.strip_prefix(base) {
            out.push((rel.to_string_lossy().replace('\\', "/"), p.clone()));
        }
    }
}

fn main() {
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let assets = manifest.join("assets");
    println!("cargo:rerun-if-changed={}", assets.display());
    let mut files = Vec::new();
    walk(&assets, &assets, &mut files);
    let mut code = String::from(
        "/// The dashboard's files: (path under assets/, contents).\npub static ASSETS: &[(&str, &[u8])] = &[\n",
    );
    for (rel, abs) in files {
        code.push_str(&format!("    ({rel:?}, include_bytes!({:?})),\n", abs.display().to_string()));
    }
    code.push_str("];\n");
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR")).join("assets.rs");
    std::fs::write(out, code).expect("write assets.rs");
}
