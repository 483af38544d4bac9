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
package memimage
