//! The shared objects mapped into this process, read from `/proc/self/maps`.
//!
//! Each line is `start-end perms offset dev inode pathname`; a shared object appears once per
//! mapped segment. We keep file-backed paths whose file name looks like a shared object
//! (`*.so` or `*.so.N...`), once each, in the order they first appear.

use std::path::PathBuf;

/// Paths of the shared objects in a `/proc/<pid>/maps` text, deduplicated, in first-seen order.
pub fn shared_objects(maps: &str) -> Vec<PathBuf> {
    let mut seen = std::collections::HashSet::new();
    let mut out = Vec::new();
    for line in maps.lines() {
        let Some(path) = pathname(line) else { continue };
        if !is_shared_object_name(path) {
            continue;
        }
        if seen.insert(path.to_owned()) {
            out.push(PathBuf::from(path));
        }
    }
    out
}

/// The shared objects mapped into the calling process right now.
pub fn current_process() -> std::io::Result<Vec<PathBuf>> {
    Ok(shared_objects(&std::fs::read_to_string("/proc/self/maps")?))
}

/// The pathname column: everything after the fifth field, which may contain spaces. Only absolute
/// paths count (pseudo entries are `[heap]`, `[vdso]`, ...); a deleted file ends in " (deleted)".
fn pathname(line: &str) -> Option<&str> {
    let mut rest = line;
    for _ in 0..5 {
        rest = rest.trim_start();
        let end = rest.find(char::is_whitespace)?;
        rest = &rest[end..];
    }
    let path = rest.trim();
    if !path.starts_with('/') || path.ends_with(" (deleted)") {
        return None;
    }
    Some(path)
}

/// `libfoo.so`, `libfoo.so.1`, `libfoo.so.1.2.3`, `foo-plugin.so`.
fn is_shared_object_name(path: &str) -> bool {
    let name = path.rsplit('/').next().unwrap_or(path);
    match name.find(".so") {
        Some(i) => {
            let tail = &name[i + 3..];
            tail.is_empty() || (tail.starts_with('.') && tail[1..].split('.').all(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit())))
        }
        None => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAPS: &str = "\
55d0c0a00000-55d0c0a2a000 r--p 00000000 08:01 1311 /usr/lib/erlang/erts-13.1.5/bin/beam.smp
7f0a10000000-7f0a10021000 rw-p 00000000 00:00 0
7f0a1a000000-7f0a1a200000 r--p 00000000 08:01 2001 /opt/app/_build/lib/exla/priv/xla_extension/lib/libxla_extension.so
7f0a1a200000-7f0a1c000000 r-xp 00200000 08:01 2001 /opt/app/_build/lib/exla/priv/xla_extension/lib/libxla_extension.so
7f0a1d000000-7f0a1d100000 r-xp 00000000 08:01 2002 /usr/lib/x86_64-linux-gnu/libstdc++.so.6.0.30
7f0a1e000000-7f0a1e100000 r-xp 00000000 08:01 2003 /home/me/my plugins/pjrt_c_api_cpu_plugin.so
7f0a1f000000-7f0a1f100000 r-xp 00000000 08:01 2004 /tmp/old.so (deleted)
7f0a20000000-7f0a20001000 r--p 00000000 08:01 2005 /usr/lib/locale/C.utf8/LC_CTYPE
7f0a21000000-7f0a21001000 r--p 00000000 08:01 2006 /usr/lib/x86_64-linux-gnu/libc.so.6
7f0a22000000-7f0a22001000 r--p 00000000 08:01 2007 /data/weights.sonnet
7ffd1c000000-7ffd1c021000 rw-p 00000000 00:00 0                          [stack]
7ffd1c200000-7ffd1c202000 r-xp 00000000 00:00 0                          [vdso]
";

    #[test]
    fn keeps_each_shared_object_once_in_order() {
        let got: Vec<String> = shared_objects(MAPS).iter().map(|p| p.display().to_string()).collect();
        assert_eq!(
            got,
            [
                "/opt/app/_build/lib/exla/priv/xla_extension/lib/libxla_extension.so",
                "/usr/lib/x86_64-linux-gnu/libstdc++.so.6.0.30",
                "/home/me/my plugins/pjrt_c_api_cpu_plugin.so",
                "/usr/lib/x86_64-linux-gnu/libc.so.6",
            ]
        );
    }

    #[test]
    fn names() {
        assert!(is_shared_object_name("/a/libx.so"));
        assert!(is_shared_object_name("/a/libx.so.1.2"));
        assert!(!is_shared_object_name("/a/libx.so.bak"));
        assert!(!is_shared_object_name("/a/x.sonnet"));
        assert!(!is_shared_object_name("/a/beam.smp"));
    }

    #[test]
    fn reads_this_process() {
        let libs = current_process().unwrap();
        assert!(libs.iter().any(|p| p.file_name().unwrap().to_string_lossy().starts_with("libc.so")), "{libs:?}");
    }
}
