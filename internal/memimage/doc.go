// Package memimage reads the guest memory a VMM process wrote and builds
// guest memory image files from it: the RAM side of "branch", snapshotting
// a running child.
//
// A child VMM maps its snapshot's memory file MAP_PRIVATE, so the pages its
// guest wrote are private anonymous pages inside that mapping, and every
// other page still reads from the file. Private finds the written pages
// from /proc/PID/pagemap; Copy copies them out of the process into an image
// file at their image offsets. A memory image is the guest RAM regions of a
// vmm.MemoryMap laid end to end in the order given (guest-physical order);
// page index i is the bytes [i*PageSize, (i+1)*PageSize) of the image.
//
// Image files are sparse. A layer (CreateLayer) holds only the pages copied
// into it; its holes read through to the image below it. Materialize and
// Flatten turn a base and its layers into one flat image, so that mapping
// an image at any depth of a chain costs what mapping a flat one costs.
// SparseCopy copies an image keeping its holes (a reflink where the
// filesystem has them); CreateLayerFrom starts a full image that way.
//
// A branch, with the guest's pause kept to the pages it wrote (errors
// elided):
//
//	l, _ := CreateLayerFrom(out, base)   // or CreateLayer(out, ImageSize(mm))
//	p, _ := Private(mm); l.Copy(mm, p)   // optional pre-copy, guest running
//	// pause the guest
//	p, _ = Private(mm); l.Copy(mm, p)    // exact now
//	// resume the guest
//	l.Commit()                           // fsync + rename, outside the pause
//
// Costs (BenchmarkPrivate, BenchmarkCopy, BenchmarkMaterialize), measured
// on a 2-core shared VM without KVM at load 4-10, ext4, for mappings with
// 5% of their pages written, either as single pages (scattered) or in runs
// of 64 pages:
//
//   - Private: 0.4-1.2 ms for 256 MiB; 1.3-1.7 ms for 1 GiB (runs), 2.2-5.7
//     ms (scattered). Mostly the kernel's pagemap walk; one pread per region.
//   - Copy, 51 MiB of a 1 GiB guest: 10-28 ms in runs over pages dst already
//     holds (a pre-copy's), 13-37 ms into new page cache (1.4-5 GB/s). Single
//     pages cost one pwrite each, 3.5-11 µs: 45-150 ms for 12,600 of them.
//     Writing through a MAP_SHARED mapping of dst instead of pwrite was no
//     faster over held pages and 25-100 times slower into new ones.
//   - Materialize of a 256 MiB image (128 MiB of base data, a 5% layer),
//     fsync included: 1.0-1.15 s.
//
// Neither Private nor Copy makes a syscall per page where pages form runs,
// nor allocates per page.
package memimage
