//! The kernel modules soft-RoCE needs: the image carries them (its `on_demand` modules, not
//! loaded at boot) and the suite loads them from those files, dependencies first (each
//! file's `.modinfo` `depends=`), unless they are loaded already. `rdma_rxe` asks for its CRC by name at `rdma link add` time, and
//! the image has no modprobe index, so `crc32_generic` is loaded by name too.

use std::collections::BTreeMap;
use std::path::Path;

use crate::context::Context;
use crate::ktap::{Check, Verdict};
use crate::sys;

/// What soft-RoCE and userspace verbs need, in load order.
pub const RDMA_MODULES: &[&str] = &["crc32_generic", "rdma_rxe", "ib_uverbs", "rdma_ucm"];

/// A module's name as the kernel writes it (dashes are underscores).
fn norm(name: &str) -> String {
    name.replace('-', "_")
}

/// The `depends=` list of a module file's `.modinfo` (entries are NUL-separated).
pub fn depends(ko: &[u8]) -> Vec<String> {
    const KEY: &[u8] = b"depends=";
    let mut at = 0;
    while let Some(i) = ko[at..].windows(KEY.len()).position(|w| w == KEY) {
        let start = at + i;
        if start == 0 || ko[start - 1] == 0 {
            let value = &ko[start + KEY.len()..];
            let end = value.iter().position(|&b| b == 0).unwrap_or(value.len());
            return String::from_utf8_lossy(&value[..end]).split(',').filter(|d| !d.is_empty()).map(norm).collect();
        }
        at = start + 1;
    }
    Vec::new()
}

/// Whether module `name` is loaded (or built in with a sysfs entry).
pub fn loaded(ctx: &Context, name: &str) -> bool {
    ctx.path(&format!("/sys/module/{}", norm(name))).is_dir()
}

/// The driver `/proc/crypto` registers for algorithm `alg`, if any.
pub fn crypto_driver(ctx: &Context, alg: &str) -> Option<String> {
    let text = std::fs::read_to_string(ctx.path("/proc/crypto")).ok()?;
    let field = |line: &str, key: &str| {
        let (k, v) = line.split_once(':')?;
        (k.trim() == key).then(|| v.trim().to_owned())
    };
    let mut name = None;
    for line in text.lines() {
        if let Some(n) = field(line, "name") {
            name = Some(n);
        } else if let Some(d) = field(line, "driver") {
            if name.as_deref() == Some(alg) {
                return Some(d);
            }
        }
    }
    None
}

/// What it takes to have `wanted` loaded.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Plan {
    /// Modules already loaded.
    pub loaded: Vec<String>,
    /// Modules to load, dependencies first, with their file in the guest.
    pub load: Vec<(String, String)>,
    /// What stands in for a module that is neither loaded nor in the image.
    pub provided: Vec<String>,
    /// Modules that cannot be had, with why.
    pub missing: Vec<String>,
}

/// Works out what to load for `wanted` from the image's module list.
pub fn plan(ctx: &Context, wanted: &[&str]) -> Plan {
    let files: BTreeMap<String, String> = ctx
        .image
        .iter()
        .flat_map(|i| i.modules.iter().chain(&i.optional_modules).chain(&i.on_demand_modules))
        .filter_map(|p| Some((norm(&Path::new(p).file_stem()?.to_string_lossy()), p.clone())))
        .collect();
    let mut plan = Plan::default();
    let mut seen = Vec::new();
    for name in wanted {
        visit(ctx, &files, &norm(name), &mut seen, &mut plan, 0);
    }
    plan
}

fn visit(
    ctx: &Context,
    files: &BTreeMap<String, String>,
    name: &str,
    seen: &mut Vec<String>,
    plan: &mut Plan,
    depth: usize,
) {
    if seen.iter().any(|s| s == name) || depth > 16 {
        return;
    }
    seen.push(name.to_owned());
    if loaded(ctx, name) {
        plan.loaded.push(name.to_owned());
        return;
    }
    if let Some(file) = files.get(name) {
        match std::fs::read(ctx.path(file)) {
            Ok(bytes) => {
                for dep in depends(&bytes) {
                    visit(ctx, files, &dep, seen, plan, depth + 1);
                }
                plan.load.push((name.to_owned(), file.clone()));
            }
            Err(e) => plan.missing.push(format!("{name}: cannot read {file}: {e}")),
        }
        return;
    }
    if name == "crc32_generic" {
        if let Some(driver) = crypto_driver(ctx, "crc32") {
            plan.provided.push(format!("crc32 by {driver}"));
            return;
        }
    }
    let why = if ctx.image.is_some() {
        "not loaded and not in the image (its recipe's [layer.rdma] on_demand must list it)"
    } else {
        "not loaded (no gdrvm image to load it from)"
    };
    plan.missing.push(format!("{name}: {why}"));
}

/// Loads what `wanted` needs; the check says what was loaded and what is missing.
pub fn ensure(ctx: &Context, wanted: &[&str]) -> Check {
    const NAME: &str = "rdma_modules";
    let plan = plan(ctx, wanted);
    let mut notes = Vec::new();
    if !plan.loaded.is_empty() {
        notes.push(format!("already loaded: {}", plan.loaded.join(", ")));
    }
    if !plan.provided.is_empty() {
        notes.push(format!("provided otherwise: {}", plan.provided.join(", ")));
    }
    let mut problems = plan.missing.clone();
    let mut now = Vec::new();
    for (name, file) in &plan.load {
        match sys::load_module(&ctx.path(file), "") {
            Ok(()) => now.push(name.clone()),
            Err(e) => problems.push(format!("cannot load {file}: {e}")),
        }
    }
    if !now.is_empty() {
        notes.push(format!("loaded now: {}", now.join(", ")));
    }
    let verdict = match (problems.is_empty(), ctx.image.is_some()) {
        (true, _) => Verdict::Pass,
        (false, true) => Verdict::Fail(problems.join("; ")),
        (false, false) => Verdict::Skip(format!("soft-RoCE is not available here: {}", problems.join("; "))),
    };
    Check { diagnostics: notes, ..Check::new(NAME, verdict) }
}

#[cfg(test)]
mod tests {
    use gdrvm_model::ImageManifest;

    use super::*;

    fn ko(depends: &str) -> Vec<u8> {
        let mut b = b"\x7fELF....junk depends=not_this\0".to_vec();
        b.extend_from_slice(b"\0\0license=Dual BSD/GPL\0depends=");
        b.extend_from_slice(depends.as_bytes());
        b.extend_from_slice(b"\0retpoline=Y\0name=x\0");
        b
    }

    #[test]
    fn test_modinfo_depends() {
        assert_eq!(
            depends(&ko("ib_core,ip6_udp_tunnel,udp_tunnel,ib_uverbs")),
            ["ib_core", "ip6_udp_tunnel", "udp_tunnel", "ib_uverbs"]
        );
        assert_eq!(depends(&ko("")), Vec::<String>::new());
        assert_eq!(depends(b"depends=a-b\0"), ["a_b"]);
        assert_eq!(depends(b"no modinfo here"), Vec::<String>::new());
    }

    fn ctx(root: &Path, modules: &[&str], optional: &[&str]) -> Context {
        Context {
            expect: None,
            image: Some(ImageManifest {
                name: "default".into(),
                kernel_release: "6.1.0-57-amd64".into(),
                modules: modules.iter().map(|m| m.to_string()).collect(),
                optional_modules: vec![],
                on_demand_modules: optional.iter().map(|m| m.to_string()).collect(),
                left_out_layers: Default::default(),
                user_modules: vec![],
            }),
            root: root.to_owned(),
            kernel_log: Ok(String::new()),
            module_errors: vec![],
            modules_left_out: vec![],
        }
    }

    #[test]
    fn test_plan_loads_dependencies_first_and_skips_loaded() {
        let root = tempfile::tempdir().unwrap();
        let m = root.path().join("lib/modules");
        std::fs::create_dir_all(&m).unwrap();
        for (name, deps) in [
            ("ib_core", ""),
            ("ib_uverbs", "ib_core"),
            ("rdma_rxe", "ib_core,ip6_udp_tunnel,udp_tunnel,ib_uverbs"),
            ("udp_tunnel", ""),
            ("ip6_udp_tunnel", ""),
            ("crc32_generic", ""),
            ("iw_cm", "ib_core"),
            ("ib_cm", "ib_core"),
            ("rdma_cm", "ib_core,iw_cm,ib_cm"),
            ("rdma_ucm", "ib_core,rdma_cm,ib_uverbs"),
        ] {
            std::fs::write(m.join(format!("{name}.ko")), ko(deps)).unwrap();
        }
        std::fs::create_dir_all(root.path().join("sys/module/udp_tunnel")).unwrap();
        let all = [
            "/lib/modules/ib_core.ko",
            "/lib/modules/ib_uverbs.ko",
            "/lib/modules/udp_tunnel.ko",
            "/lib/modules/ip6_udp_tunnel.ko",
            "/lib/modules/rdma_rxe.ko",
            "/lib/modules/crc32_generic.ko",
            "/lib/modules/iw_cm.ko",
            "/lib/modules/ib_cm.ko",
            "/lib/modules/rdma_cm.ko",
            "/lib/modules/rdma_ucm.ko",
        ];
        let p = plan(&ctx(root.path(), &["/lib/modules/virtio_net.ko"], &all), RDMA_MODULES);
        let order: Vec<&str> = p.load.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            order,
            [
                "crc32_generic",
                "ib_core",
                "ip6_udp_tunnel",
                "ib_uverbs",
                "rdma_rxe",
                "iw_cm",
                "ib_cm",
                "rdma_cm",
                "rdma_ucm"
            ]
        );
        assert_eq!(p.loaded, ["udp_tunnel"]);
        assert!(p.missing.is_empty(), "{:?}", p.missing);
        assert_eq!(p.load[4].1, "/lib/modules/rdma_rxe.ko");
    }

    #[test]
    fn test_missing_modules_are_named_and_crc32_may_be_built_in() {
        let root = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(root.path().join("proc")).unwrap();
        std::fs::write(
            root.path().join("proc/crypto"),
            "name         : crc32c\ndriver       : crc32c-intel\n\nname         : crc32\ndriver       : crc32-pclmul\nmodule       : kernel\n",
        )
        .unwrap();
        std::fs::create_dir_all(root.path().join("sys/module/ib_uverbs")).unwrap();
        let p = plan(&ctx(root.path(), &[], &[]), RDMA_MODULES);
        assert_eq!(p.provided, ["crc32 by crc32-pclmul"]);
        assert_eq!(p.loaded, ["ib_uverbs"]);
        assert_eq!(
            p.missing,
            [
                "rdma_rxe: not loaded and not in the image (its recipe's [layer.rdma] on_demand must list it)",
                "rdma_ucm: not loaded and not in the image (its recipe's [layer.rdma] on_demand must list it)",
            ]
        );
        let check = ensure(&ctx(root.path(), &[], &[]), RDMA_MODULES);
        assert!(matches!(&check.verdict, Verdict::Fail(r) if r.starts_with("rdma_rxe: not loaded")), "{check:?}");
        let bare = Context { image: None, ..ctx(root.path(), &[], &[]) };
        let check = ensure(&bare, RDMA_MODULES);
        assert!(matches!(&check.verdict, Verdict::Skip(r) if r.contains("no gdrvm image")), "{check:?}");
    }
}
