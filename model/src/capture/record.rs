//! Recording the part of a sysfs tree that [`capture`](super::capture) reads, as text lines
//! that travel over a guest's console, and writing such a recording back as a tree that
//! `--sysfs` reads: how the guests gdrvm boots become fixtures for capture's unit tests.
//! The same files as `fixtures/record-sysfs.sh` (which records a live host with a shell):
//! for every PCI function its IDs, class, subsystem, `numa_node`, `resource`, `config`,
//! link speeds and widths and its `physfn`/`virtfn` links, and its link in
//! `sys/bus/pci/devices`; every NUMA node's `cpulist`, `distance`, `meminfo` and memory
//! block links; the memory block size, the online CPUs and `/proc/meminfo`.
//!
//! A line is `T PATH TEXT` (a text file, `\\`, `\n`, `\t` and `\s` standing for a backslash,
//! newline, tab and space), `F PATH LEN DATA` (any other file of LEN bytes: DATA its bytes
//! in hex up to the last non-zero one, `zN.` for a run of N zero bytes, since a 4 KiB
//! `config` is mostly zeros) or `L PATH TARGET` (a symlink), PATH relative to the root.
//! Names in sysfs have no spaces. Every byte costs a VM exit on a serial console, hence the
//! short forms.

use std::path::{Component, Path, PathBuf};

/// The kernel command-line word that makes the agent's `capture` suite print a recording.
pub const CMDLINE_FLAG: &str = "gdrvm.record_sysfs";

/// What starts each recorded line among the suite's diagnostics.
pub const LINE_PREFIX: &str = "sysfs-record ";

/// The files of a PCI function that capture reads.
const FUNCTION_FILES: [&str; 12] = [
    "vendor",
    "device",
    "class",
    "subsystem_vendor",
    "subsystem_device",
    "numa_node",
    "resource",
    "config",
    "current_link_speed",
    "current_link_width",
    "max_link_speed",
    "max_link_width",
];

/// Files read outside the PCI functions, when present.
const SYSTEM_FILES: [&str; 3] =
    ["sys/devices/system/memory/block_size_bytes", "sys/devices/system/cpu/online", "proc/meminfo"];

/// One recorded entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Entry {
    /// A file and its bytes.
    File(Vec<u8>),
    /// A symlink and its target, as the kernel wrote it (relative in sysfs).
    Link(PathBuf),
}

/// An entry at `path`, relative to the root it was recorded from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recorded {
    /// Where, relative to the root.
    pub path: PathBuf,
    /// What.
    pub entry: Entry,
}

/// Why a recording could not be made or written back.
#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    /// A directory or file of the tree is unreadable.
    #[error("cannot read {}", path.display())]
    Read {
        /// Where.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A line that is not a recording's.
    #[error("line {line}: {reason}")]
    Line {
        /// Its number, from 1.
        line: usize,
        /// What is wrong.
        reason: String,
    },
    /// The tree could not be written.
    #[error("cannot write {}", path.display())]
    Write {
        /// Where.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

fn read_error(path: &Path) -> impl FnOnce(std::io::Error) -> RecordError + '_ {
    move |source| RecordError::Read { path: path.to_owned(), source }
}

/// Records what capture reads below `root` (`/` for this machine).
pub fn record(root: &Path) -> Result<Vec<Recorded>, RecordError> {
    let mut out = Vec::new();
    let relative = |p: &Path| p.strip_prefix(root).map(Path::to_owned).unwrap_or_else(|_| p.to_owned());
    let file = |out: &mut Vec<Recorded>, path: &Path| {
        // Files a kernel has but refuses to read (a link speed of a port without a link)
        // are left out, as the shell recorder leaves them.
        if let Ok(bytes) = std::fs::read(path) {
            out.push(Recorded { path: relative(path), entry: Entry::File(bytes) });
        }
    };
    let link = |out: &mut Vec<Recorded>, path: &Path| -> Result<(), RecordError> {
        let target = std::fs::read_link(path).map_err(read_error(path))?;
        out.push(Recorded { path: relative(path), entry: Entry::Link(target) });
        Ok(())
    };
    let devices = root.join("sys/bus/pci/devices");
    for name in sorted_names(&devices)? {
        let at = devices.join(&name);
        link(&mut out, &at)?;
        let real = std::fs::canonicalize(&at).map_err(read_error(&at))?;
        for f in FUNCTION_FILES {
            file(&mut out, &real.join(f));
        }
        for n in sorted_names(&real)?.iter().filter(|n| *n == "physfn" || n.starts_with("virtfn")) {
            link(&mut out, &real.join(n))?;
        }
    }
    let nodes = root.join("sys/devices/system/node");
    if nodes.is_dir() {
        for name in sorted_names(&nodes)?.iter().filter(|n| n.strip_prefix("node").is_some_and(is_number)) {
            let node = nodes.join(name);
            for f in ["cpulist", "distance", "meminfo"] {
                file(&mut out, &node.join(f));
            }
            for n in sorted_names(&node)?.iter().filter(|n| n.strip_prefix("memory").is_some_and(is_number)) {
                link(&mut out, &node.join(n))?;
            }
        }
    }
    for f in SYSTEM_FILES {
        file(&mut out, &root.join(f));
    }
    Ok(out)
}

fn is_number(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit())
}

fn sorted_names(dir: &Path) -> Result<Vec<String>, RecordError> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .map_err(read_error(dir))?
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .collect();
    names.sort();
    Ok(names)
}

impl Recorded {
    /// The entry as one line (see the module's doc).
    pub fn line(&self) -> String {
        match &self.entry {
            Entry::File(bytes) => match text_form(bytes) {
                Some(text) => format!("T {} {text}", self.path.display()),
                None => format!("F {} {} {}", self.path.display(), bytes.len(), binary_form(bytes)),
            },
            Entry::Link(target) => format!("L {} {}", self.path.display(), target.display()),
        }
    }

    /// An entry from its [`Recorded::line`]; `number` names the line in errors.
    pub fn parse(line: &str, number: usize) -> Result<Recorded, RecordError> {
        let bad = |reason: &str| RecordError::Line { line: number, reason: format!("{reason}: '{line}'") };
        let mut words = line.split(' ');
        let (kind, path) = (words.next(), words.next().map(PathBuf::from));
        let path = path.filter(|p| is_relative_below(p)).ok_or_else(|| bad("no relative path below the root"))?;
        let entry = match kind {
            Some("T") => Entry::File(unescape(words.next().unwrap_or("")).ok_or_else(|| bad("a bad escape"))?),
            Some("F") => {
                let len: usize = words.next().and_then(|l| l.parse().ok()).ok_or_else(|| bad("no length"))?;
                let mut bytes = from_binary_form(words.next().unwrap_or(""), len).map_err(&bad)?;
                bytes.resize(len, 0);
                Entry::File(bytes)
            }
            Some("L") => Entry::Link(PathBuf::from(words.next().ok_or_else(|| bad("no target"))?)),
            _ => return Err(bad("neither T, F nor L")),
        };
        if words.next().is_some() {
            return Err(bad("more words than an entry has"));
        }
        Ok(Recorded { path, entry })
    }
}

/// `bytes` as escaped text, when they are text (UTF-8 without control characters other
/// than newline and tab).
fn text_form(bytes: &[u8]) -> Option<String> {
    let text = std::str::from_utf8(bytes).ok()?;
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\t' => out.push_str("\\t"),
            ' ' => out.push_str("\\s"),
            c if c.is_control() => return None,
            c => out.push(c),
        }
    }
    Some(out)
}

fn unescape(text: &str) -> Option<Vec<u8>> {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        out.push(match chars.next()? {
            '\\' => '\\',
            'n' => '\n',
            't' => '\t',
            's' => ' ',
            _ => return None,
        });
    }
    Some(out.into_bytes())
}

/// Zero runs shorter than this stay hex.
const ZERO_RUN: usize = 3;

/// `bytes` up to the last non-zero one, in hex with `zN.` for runs of N zero bytes.
fn binary_form(bytes: &[u8]) -> String {
    let end = bytes.iter().rposition(|b| *b != 0).map_or(0, |i| i + 1);
    let mut out = String::new();
    let mut i = 0;
    while i < end {
        let run = bytes[i..end].iter().take_while(|b| **b == 0).count();
        if run >= ZERO_RUN {
            out.push_str(&format!("z{run}."));
            i += run;
        } else {
            out.push_str(&format!("{:02x}", bytes[i]));
            i += 1;
        }
    }
    out
}

fn from_binary_form(data: &str, len: usize) -> Result<Vec<u8>, &'static str> {
    let mut out = Vec::new();
    let mut rest = data;
    while !rest.is_empty() {
        if let Some(run) = rest.strip_prefix('z') {
            let (count, after) = run.split_once('.').ok_or("a zero run without its end")?;
            let n: usize = count.parse().map_err(|_| "a zero run without its count")?;
            if out.len() + n > len {
                return Err("the bytes do not fit the length");
            }
            out.resize(out.len() + n, 0);
            rest = after;
        } else {
            let byte = rest.get(..2).and_then(|h| u8::from_str_radix(h, 16).ok()).ok_or("not hex")?;
            out.push(byte);
            rest = &rest[2..];
        }
        if out.len() > len {
            return Err("the bytes do not fit the length");
        }
    }
    Ok(out)
}

/// A path that stays below the root it is joined to.
fn is_relative_below(p: &Path) -> bool {
    p.components().next().is_some() && p.components().all(|c| matches!(c, Component::Normal(_)))
}

/// Writes `entries` as a tree below `dir` (which `capture` then reads as a sysfs root).
pub fn write(dir: &Path, entries: &[Recorded]) -> Result<(), RecordError> {
    for r in entries {
        let path = dir.join(&r.path);
        let failed = |source| RecordError::Write { path: path.clone(), source };
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).map_err(failed)?;
        }
        match &r.entry {
            Entry::File(bytes) => std::fs::write(&path, bytes).map_err(failed)?,
            Entry::Link(target) => std::os::unix::fs::symlink(target, &path).map_err(failed)?,
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::capture::{capture, CaptureOptions};

    fn dev_vm() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("src/capture/fixtures/dev-vm")
    }

    #[test]
    fn test_a_recording_written_back_captures_as_the_original() {
        let entries = record(&dev_vm()).unwrap();
        assert!(entries.iter().any(|r| r.path == Path::new("sys/bus/pci/devices/0000:00:04.0")));
        // Through lines, as over a console.
        let text: Vec<String> = entries.iter().map(Recorded::line).collect();
        let back: Vec<Recorded> = text.iter().enumerate().map(|(i, l)| Recorded::parse(l, i + 1).unwrap()).collect();
        assert_eq!(back, entries);
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), &back).unwrap();
        let (a, b) = (
            capture(&dev_vm(), &CaptureOptions::default()).unwrap(),
            capture(dir.path(), &CaptureOptions::default()).unwrap(),
        );
        assert_eq!(a.node.functions, b.node.functions);
        assert_eq!(a.node.numa, b.node.numa);
    }

    #[test]
    fn test_lines_keep_lengths_and_refuse_paths_outside() {
        let mut bytes = vec![0u8; 4096];
        bytes[..2].copy_from_slice(&[0x86, 0x80]);
        bytes[0x100] = 0x10;
        let config = Recorded { path: "sys/devices/pci0000:00/0000:00:01.0/config".into(), entry: Entry::File(bytes) };
        assert_eq!(config.line(), "F sys/devices/pci0000:00/0000:00:01.0/config 4096 8680z254.10");
        assert_eq!(Recorded::parse(&config.line(), 1).unwrap(), config);
        let text = "0x0000000000001000 0x0000000000001fff 0x0000000000040200\n\\x\t\n";
        let resource = Recorded { path: "proc/meminfo".into(), entry: Entry::File(text.as_bytes().to_vec()) };
        assert!(resource.line().starts_with("T proc/meminfo 0x0000000000001000\\s0x"), "{}", resource.line());
        assert_eq!(Recorded::parse(&resource.line(), 1).unwrap(), resource);
        let empty = Recorded { path: "proc/meminfo".into(), entry: Entry::File(vec![]) };
        assert_eq!(Recorded::parse(&empty.line(), 1).unwrap(), empty);
        let link =
            Recorded { path: "sys/bus/pci/devices/0000:00:01.0".into(), entry: Entry::Link("../../../x".into()) };
        assert_eq!(Recorded::parse(&link.line(), 1).unwrap(), link);
        for (bad, why) in [
            ("F /etc/passwd 3 616263", "no relative path"),
            ("T ../x y", "no relative path"),
            ("F x 1 6162", "do not fit"),
            ("F x 2 z3.", "do not fit"),
            ("F x 2 6g", "not hex"),
            ("F x 9 z4", "without its end"),
            ("T x a\\q", "bad escape"),
            ("X x", "neither T, F nor L"),
            ("L x", "no target"),
            ("L x y z", "more words"),
        ] {
            let e = Recorded::parse(bad, 7).unwrap_err().to_string();
            assert!(e.starts_with("line 7: ") && e.contains(why), "{bad}: {e}");
        }
    }
}
