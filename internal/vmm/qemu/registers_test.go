package qemu

import (
	"testing"

	"github.com/forkd/forkd/internal/vmm"
)

// The register dump of "info registers -a" (QEMU 7.2, x86): one block per
// vCPU; RIP and HLT are read, the rest passed over.
func TestParseRegisters(t *testing.T) {
	dump := "\r\nCPU#0\r\n" +
		"RAX=0000000000000000 RBX=0000000000000000 RCX=0000000000000001 RDX=0000000000000000\r\n" +
		"RIP=ffffffff81e17a0b RFL=00000246 [---Z-P-] CPL=0 II=0 A20=1 SMM=0 HLT=1\r\n" +
		"ES =0000 0000000000000000 00000000 00000000\r\n" +
		"CPU#1\r\n" +
		"RIP=000000000431d3fd RFL=00000006 [-----P-] CPL=0 II=0 A20=1 SMM=0 HLT=0\r\n" +
		"CR0=80050033 CR2=0000000000000000 CR3=0000000004357000 CR4=00000020\r\n"
	got := parseRegisters(dump)
	want := []vmm.CPU{{PC: 0xffffffff81e17a0b, Halted: true}, {PC: 0x431d3fd}}
	if len(got) != len(want) || got[0] != want[0] || got[1] != want[1] {
		t.Fatalf("parseRegisters = %+v, want %+v", got, want)
	}
	if got := parseRegisters("RIP=ffffffff81e17a0b HLT=1\n"); got != nil {
		t.Fatalf("a dump with no CPU# line gave %+v", got)
	}
}
