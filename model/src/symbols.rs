//! A kernel's text symbols (`/proc/kallsyms`, `System.map`: one `ADDR TYPE NAME [MODULE]`
//! line a symbol), to tell guest addresses, such as where a boot's exits come from, as
//! functions. Written by hand: no crate reads the format. A kernel booted at its ELF entry
//! (PVH, as gdrvm and QEMU boot a vmlinux) is not relocated (KASLR is the decompressor's),
//! so a guest of L1's own kernel runs at L1's addresses, and L1's kallsyms names them.

use std::path::Path;

/// Text symbols sorted by address.
pub struct SymbolMap {
    symbols: Vec<(u64, String)>,
    /// Where the kernel's own text ends (`_etext`), where the map says.
    text_end: Option<u64>,
}

impl SymbolMap {
    /// Reads the text symbols (`t`, `T`, `w`, `W`) of the symbol file at `path`.
    pub fn load(path: &Path) -> std::io::Result<SymbolMap> {
        Ok(SymbolMap::parse(&std::fs::read_to_string(path)?))
    }

    /// Parses symbol file text; lines that are not `ADDR TYPE NAME` are skipped, and so are
    /// symbols at address 0 (kallsyms read without the right to see addresses).
    pub fn parse(text: &str) -> SymbolMap {
        let mut symbols: Vec<(u64, String)> = text
            .lines()
            .filter_map(|line| {
                let mut w = line.split_whitespace();
                let addr = u64::from_str_radix(w.next()?, 16).ok()?;
                let kind = w.next()?;
                let name = w.next()?;
                (addr != 0 && matches!(kind, "t" | "T" | "w" | "W")).then(|| (addr, name.to_owned()))
            })
            .collect();
        symbols.sort();
        let text_end = symbols.iter().find(|(_, n)| n == "_etext").map(|(a, _)| *a);
        SymbolMap { symbols, text_end }
    }

    /// Whether the map holds no symbol (unreadable addresses, or not a symbol file).
    pub fn is_empty(&self) -> bool {
        self.symbols.is_empty()
    }

    /// Whether `addr` lies in the kernel's own text (below `_etext`; not init code, not
    /// modules). False where the map has no `_etext`.
    pub fn in_kernel_text(&self, addr: u64) -> bool {
        self.text_end.is_some_and(|end| addr < end) && self.symbols.first().is_some_and(|(a, _)| *a <= addr)
    }

    /// The function `addr` is in: the nearest text symbol at or below it. An address below
    /// every symbol (user space, firmware) has none.
    pub fn function(&self, addr: u64) -> Option<&str> {
        let i = self.symbols.partition_point(|(a, _)| *a <= addr);
        i.checked_sub(1).map(|i| self.symbols[i].1.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_an_address_is_told_by_the_text_symbol_at_or_below_it() {
        let map = SymbolMap::parse(
            "ffffffff81000000 T _text\n\
             ffffffff81001000 t native_cpuid\n\
             ffffffff81001040 D some_data\n\
             ffffffff81002000 W weak_fn\n\
             ffffffff81003000 T _etext\n\
             ffffffffc0001000 t virtnet_poll\t[virtio_net]\n\
             0000000000000000 T hidden\n\
             garbage line\n",
        );
        assert!(!map.is_empty());
        assert!(map.in_kernel_text(0xffffffff81002010));
        assert!(!map.in_kernel_text(0xffffffff81003000));
        assert!(!map.in_kernel_text(0xffffffffc0001004));
        assert_eq!(map.function(0xffffffffc0001004), Some("virtnet_poll"));
        assert_eq!(map.function(0xffffffff81001000), Some("native_cpuid"));
        assert_eq!(map.function(0xffffffff81001fff), Some("native_cpuid"));
        assert_eq!(map.function(0xffffffff81002010), Some("weak_fn"));
        assert_eq!(map.function(0xffffffff80ffffff), None);
        assert_eq!(map.function(0x401000), None);
    }
}
