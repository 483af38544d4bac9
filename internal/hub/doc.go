// Package hub moves warm snapshots between hosts through any OCI
// registry (push, pull), or through an OCI image layout in a tar file for
// machines no registry reaches (pack, unpack).
//
// # Format
//
// A snapshot is an OCI image manifest with artifactType ArtifactType.
// Its config blob (ConfigType, an ArtifactConfig) holds the snapshot's
// metadata — backend and version, accelerator, machine identity, the CPU
// it was made on, RAM size, content hash, the parent's manifest digest
// for a chain link — and where every byte of it is. Its layers are plain
// blobs, each listed once:
//
//   - the device state, zstd-compressed (StateType);
//   - the kernel and the initramfs as they are (KernelType, InitrdType:
//     already compressed), content-addressed, so every snapshot of one
//     image shares them;
//   - the root filesystem image in chunks (RootfsChunkType), each a
//     window of DefaultChunkBytes with its pages of zeros and its holes
//     left out, shared the same way;
//   - guest memory in chunks (MemoryChunkType): a window of
//     DefaultChunkBytes of guest RAM each, only the pages the memory
//     file has data for (its data extents: pages the guest never wrote
//     are holes and cost nothing), pages of zeros left out. A page equal
//     to a block of the kernel, initramfs or root filesystem (the guest's
//     page cache of its root filesystem, the kernel image it booted from)
//     is stored as a reference to that block. A chain link (a diff or
//     live branch, with a parent) stores its layer file: only the pages
//     that differ from its parent, pages of zeros included.
//
// A chunk, before compression, is a header (magic, page size, pages per
// window, reference count), a bitmap of the pages it restores, a bitmap
// of those stored as references, the references (source, offset), then
// the other pages' bytes; it is compressed as one zstd frame. It says
// nothing of which window it is (the config does): two versions of a
// snapshot share every window that did not change, and a registry holds
// and sends such a blob once. Encoding is deterministic, so pushing the
// same snapshot again gives the same digests.
//
// # Safety
//
// A puller trusts nothing it fetches until checked: manifests and
// configs are bounded in size and every field validated (Limits); every
// blob is fetched into a cache under a temporary name and named by its
// digest only once it hashes to it, and hashed again when read; chunks
// are decoded into bounded buffers and must restore exactly the pages
// their config says, inside their window; the pages restored must hash
// to the config's PagesSHA256 and a root filesystem to its sha256. A
// snapshot this host cannot restore (another backend, VMM version line,
// accelerator, CPU, or a machine identity the backend refuses) is refused
// after its config, before anything else is fetched. No name in a
// manifest, config or layout tar becomes a path: files are stored by
// digest, tags are validated.
//
// A pull writes its snapshot in the store's staging and commits it only
// once complete and verified, so its tag appears whole or not at all. A
// pull cut short leaves the blobs it verified in the cache
// (<Config.Dir>/blobs), and the next pull of the same snapshot fetches
// only the others. Boot files a pull brings live in a content store
// (Config.ContentDir) by sha256, shared by every snapshot that uses them
// and swept when the last of those is removed.
package hub
