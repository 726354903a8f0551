//! The vmlinux a guest boots, compacted: the long runs of zero bytes inside its loadable
//! segments (`.bss`, `.brk`, the early page-table scratch: about half of a Debian vmlinux)
//! are left out of the file and described as memory-only ranges, as ELF describes `.bss`.
//! Every ELF loader (gdrvm's, through linux-loader, and QEMU's PVH loader) puts the same
//! bytes in guest memory, which starts zeroed, so the guest sees the same kernel; but each
//! boot copies half as much, and the nested runner's L1 image carries half as much.
//!
//! Written by hand: no well-kept crate rewrites an ELF's program headers (the `object`
//! crate reads them and writes whole objects, not loadable images).
//!
//! Section headers are left out: only debuggers read them, and they read the package's
//! own vmlinux.

use object::elf::{FileHeader64, ProgramHeader64, PT_LOAD};
use object::read::elf::{FileHeader, ProgramHeader};
use object::{LittleEndian as LE, U16, U64};

/// The granule zero runs are found in, and new segments are aligned to.
const PAGE: u64 = 4096;
/// The shortest zero run left out of the file: a shorter one is not worth a program header.
const MIN_HOLE: u64 = 64 * 1024;
/// The size of an ELF64 file header.
const EHDR_SIZE: u64 = 64;
/// The size of an ELF64 program header.
const PHDR_SIZE: u64 = 56;

/// Why an ELF could not be compacted (the caller boots it as it is).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CompactError {
    /// Not a 64-bit little-endian ELF, or its headers run past the file.
    #[error("not a readable 64-bit ELF: {0}")]
    Unreadable(String),
    /// A non-loadable segment (a note) lies in no loaded data, so it could not be moved.
    #[error("segment {0} lies outside every loaded segment's data")]
    Orphan(usize),
}

/// One piece of a loadable segment in the compacted file: `file_len` bytes of data from
/// `from` (an offset in the original file), followed in memory by zeros up to `mem_len`.
#[derive(Debug, Clone, Copy)]
struct Piece {
    segment: usize,
    /// Offset from the segment's start, in memory and in the original file alike.
    rel: u64,
    from: u64,
    file_len: u64,
    mem_len: u64,
}

/// Returns `elf` with its long zero runs left out of the file, or why it cannot be done.
/// An ELF with nothing to leave out comes back with the same loadable image as well.
pub fn compact(elf: &[u8]) -> Result<Vec<u8>, CompactError> {
    let unreadable = |e: object::read::Error| CompactError::Unreadable(e.to_string());
    let header = FileHeader64::<LE>::parse(elf).map_err(unreadable)?;
    let phdrs = header.program_headers(LE, elf).map_err(unreadable)?;

    let mut pieces = Vec::new();
    for (i, ph) in phdrs.iter().enumerate() {
        if ph.p_type(LE) == PT_LOAD && ph.p_filesz(LE) > 0 {
            let data =
                ph.data(LE, elf).map_err(|()| CompactError::Unreadable(format!("segment {i} runs past the file")))?;
            pieces.extend(split(i, ph.p_offset(LE), data, ph.p_memsz(LE)));
        }
    }
    let others: Vec<usize> =
        phdrs.iter().enumerate().filter(|(_, ph)| ph.p_type(LE) != PT_LOAD).map(|(i, _)| i).collect();

    // The file: header, program headers, then each piece on its own page, at the offset
    // its address has within a page (ELF's p_offset ≡ p_vaddr rule).
    let count = pieces.len() + others.len();
    let mut at = (EHDR_SIZE + PHDR_SIZE * count as u64).next_multiple_of(PAGE);
    let mut placed = Vec::with_capacity(pieces.len());
    for p in &pieces {
        let vaddr = phdrs[p.segment].p_vaddr(LE) + p.rel;
        let offset = at + vaddr % PAGE;
        placed.push(offset);
        at = (offset + p.file_len).next_multiple_of(PAGE);
    }

    let mut out = Vec::with_capacity(at as usize);
    let mut head = *header;
    head.e_phoff = U64::new(LE, EHDR_SIZE);
    head.e_phentsize = U16::new(LE, PHDR_SIZE as u16);
    head.e_phnum =
        U16::new(LE, u16::try_from(count).map_err(|_| CompactError::Unreadable("too many segments".into()))?);
    head.e_shoff = U64::new(LE, 0);
    head.e_shnum = U16::new(LE, 0);
    head.e_shstrndx = U16::new(LE, 0);
    out.extend_from_slice(object::bytes_of(&head));
    for (p, &offset) in pieces.iter().zip(&placed) {
        let mut ph = phdrs[p.segment];
        ph.p_offset = U64::new(LE, offset);
        ph.p_vaddr = U64::new(LE, ph.p_vaddr(LE) + p.rel);
        ph.p_paddr = U64::new(LE, ph.p_paddr(LE) + p.rel);
        ph.p_filesz = U64::new(LE, p.file_len);
        ph.p_memsz = U64::new(LE, p.mem_len);
        ph.p_align = U64::new(LE, PAGE);
        out.extend_from_slice(object::bytes_of(&ph));
    }
    for &i in &others {
        let mut ph: ProgramHeader64<LE> = phdrs[i];
        let (from, len) = (ph.p_offset(LE), ph.p_filesz(LE));
        if len > 0 {
            let (p, offset) = pieces
                .iter()
                .zip(&placed)
                .find(|(p, _)| from >= p.from && from + len <= p.from + p.file_len)
                .ok_or(CompactError::Orphan(i))?;
            ph.p_offset = U64::new(LE, offset + (from - p.from));
        }
        out.extend_from_slice(object::bytes_of(&ph));
    }
    for (p, &offset) in pieces.iter().zip(&placed) {
        out.resize(offset as usize, 0);
        out.extend_from_slice(&elf[p.from as usize..(p.from + p.file_len) as usize]);
    }
    Ok(out)
}

/// Splits one loadable segment at its zero runs of [`MIN_HOLE`] or more. A run at the
/// segment's very start stays in the file, so that every piece has data (some loaders skip
/// a segment with none, and would not count its memory).
fn split(segment: usize, offset: u64, data: &[u8], memsz: u64) -> Vec<Piece> {
    let zero_page = |rel: u64| {
        let end = (rel + PAGE).min(data.len() as u64);
        data[rel as usize..end as usize].iter().all(|&b| b == 0)
    };
    let mut pieces: Vec<Piece> = Vec::new();
    let mut start = 0u64;
    let mut rel = 0u64;
    let len = data.len() as u64;
    while rel < len {
        if !zero_page(rel) {
            rel += PAGE;
            continue;
        }
        let run = rel;
        while rel < len && zero_page(rel) {
            rel += PAGE;
        }
        let end = rel.min(len);
        if run > start && end - run >= MIN_HOLE {
            pieces.push(Piece {
                segment,
                rel: start,
                from: offset + start,
                file_len: run - start,
                mem_len: end - start,
            });
            start = end;
        }
    }
    if start < len {
        pieces.push(Piece { segment, rel: start, from: offset + start, file_len: len - start, mem_len: 0 });
    }
    // The last piece's memory runs to the segment's end (its .bss).
    if let Some(last) = pieces.last_mut() {
        last.mem_len = memsz.max(len) - last.rel;
    }
    pieces
}

#[cfg(test)]
mod tests {
    use super::*;
    use object::elf::{PT_NOTE, SHN_UNDEF};
    use object::U32;

    /// The guest memory an ELF's loadable segments make: (physical address, bytes).
    fn load(elf: &[u8]) -> Vec<u8> {
        let header = FileHeader64::<LE>::parse(elf).unwrap();
        let mut mem = vec![0u8; 0x40_0000];
        for ph in header.program_headers(LE, elf).unwrap().iter().filter(|p| p.p_type(LE) == PT_LOAD) {
            let at = ph.p_paddr(LE) as usize;
            mem[at..at + ph.p_filesz(LE) as usize].copy_from_slice(ph.data(LE, elf).unwrap());
            assert!(ph.p_memsz(LE) >= ph.p_filesz(LE));
            assert_eq!(ph.p_offset(LE) % PAGE, ph.p_vaddr(LE) % PAGE, "offset and address agree within a page");
        }
        mem
    }

    fn phdr(kind: u32, offset: u64, addr: u64, filesz: u64, memsz: u64) -> ProgramHeader64<LE> {
        ProgramHeader64 {
            p_type: U32::new(LE, kind),
            p_flags: U32::new(LE, 5),
            p_offset: U64::new(LE, offset),
            p_vaddr: U64::new(LE, 0xffff_ffff_8000_0000 + addr),
            p_paddr: U64::new(LE, addr),
            p_filesz: U64::new(LE, filesz),
            p_memsz: U64::new(LE, memsz),
            p_align: U64::new(LE, 0x20_0000),
        }
    }

    /// A vmlinux-like ELF: one segment of text, a long zero run, more text, a zero tail
    /// and a .bss beyond the file; a second segment wholly data; a note inside the text.
    fn fake_vmlinux() -> Vec<u8> {
        let mut file = vec![0u8; 0x30_0000];
        let text = |file: &mut Vec<u8>, at: usize, len: usize| {
            for (i, b) in file[at..at + len].iter_mut().enumerate() {
                *b = (i % 251) as u8 | 1;
            }
        };
        text(&mut file, 0x1000, 0x8000); // segment 0 starts at file 0x1000
        text(&mut file, 0x9_1000, 0x3000); // after 0x88000 zero bytes
                                           // segment 0: file 0x1000..0x10_1000 (a zero tail from 0x9_4000), memory to 0x18_0000
        text(&mut file, 0x20_0000, 0x2_0000); // segment 1: all data
        let phdrs = [
            phdr(PT_LOAD, 0x1000, 0x10_1000, 0x10_0000, 0x18_0000),
            phdr(PT_NOTE, 0x9_2000, 0x19_2000, 0x40, 0x40),
            phdr(PT_LOAD, 0x20_0000, 0x30_0000, 0x2_0000, 0x2_0000),
        ];
        let head = FileHeader64::<LE> {
            e_ident: object::elf::Ident {
                magic: object::elf::ELFMAG,
                class: object::elf::ELFCLASS64,
                data: object::elf::ELFDATA2LSB,
                version: object::elf::EV_CURRENT,
                os_abi: 0,
                abi_version: 0,
                padding: [0; 7],
            },
            e_type: U16::new(LE, object::elf::ET_EXEC),
            e_machine: U16::new(LE, object::elf::EM_X86_64),
            e_version: U32::new(LE, 1),
            e_entry: U64::new(LE, 0x10_1000),
            e_phoff: U64::new(LE, 0x40),
            e_shoff: U64::new(LE, 0),
            e_flags: U32::new(LE, 0),
            e_ehsize: U16::new(LE, 64),
            e_phentsize: U16::new(LE, 56),
            e_phnum: U16::new(LE, phdrs.len() as u16),
            e_shentsize: U16::new(LE, 64),
            e_shnum: U16::new(LE, 0),
            e_shstrndx: U16::new(LE, SHN_UNDEF),
        };
        file[..64].copy_from_slice(object::bytes_of(&head));
        for (i, p) in phdrs.iter().enumerate() {
            file[64 + 56 * i..64 + 56 * (i + 1)].copy_from_slice(object::bytes_of(p));
        }
        file
    }

    #[test]
    fn test_compacted_elf_loads_the_same_memory_from_a_smaller_file() {
        let elf = fake_vmlinux();
        let small = compact(&elf).unwrap();
        assert_eq!(load(&small), load(&elf));
        assert!(small.len() < elf.len() / 4, "{} bytes of {}", small.len(), elf.len());
        let header = FileHeader64::<LE>::parse(&*small).unwrap();
        let phdrs = header.program_headers(LE, &*small).unwrap();
        let loads: Vec<_> = phdrs.iter().filter(|p| p.p_type(LE) == PT_LOAD).collect();
        // Segment 0 splits at its zero run; its zero tail and .bss become memory only.
        assert_eq!(loads.len(), 3);
        assert_eq!((loads[0].p_paddr(LE), loads[0].p_filesz(LE), loads[0].p_memsz(LE)), (0x10_1000, 0x8000, 0x9_0000));
        assert_eq!((loads[1].p_paddr(LE), loads[1].p_filesz(LE)), (0x19_1000, 0x3000));
        assert_eq!(loads[1].p_paddr(LE) + loads[1].p_memsz(LE), 0x10_1000 + 0x18_0000);
        assert_eq!(header.e_entry(LE), 0x10_1000);
        assert_eq!(header.e_shnum(LE), 0);
    }

    #[test]
    fn test_notes_move_with_their_data() {
        let elf = fake_vmlinux();
        let small = compact(&elf).unwrap();
        let note = |elf: &[u8]| {
            let header = FileHeader64::<LE>::parse(elf).unwrap();
            let phdrs = header.program_headers(LE, elf).unwrap();
            phdrs.iter().find(|p| p.p_type(LE) == PT_NOTE).unwrap().data(LE, elf).unwrap().to_vec()
        };
        assert_eq!(note(&small), note(&elf));
    }

    #[test]
    fn test_a_segment_without_long_zero_runs_stays_whole() {
        let data = vec![7u8; 0x5000];
        let pieces = split(0, 0x1000, &data, 0x9000);
        assert_eq!(pieces.len(), 1);
        assert_eq!((pieces[0].from, pieces[0].file_len, pieces[0].mem_len), (0x1000, 0x5000, 0x9000));
        // A zero run at the very start stays in the file.
        let mut data = vec![0u8; 0x2_0000];
        data.extend(vec![1u8; 0x1000]);
        assert_eq!(split(0, 0, &data, 0x2_1000).len(), 1);
    }

    #[test]
    fn test_garbage_is_refused() {
        assert!(matches!(compact(b"not an elf"), Err(CompactError::Unreadable(_))));
    }
}
