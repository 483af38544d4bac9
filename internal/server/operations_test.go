package server

import (
	"fmt"
	"os"
	"testing"

	apiv1 "github.com/forkd/forkd/api/v1"
	"github.com/forkd/forkd/internal/errdefs"
)

// Running operations are bounded, finished ones pruned to keepOperations,
// and pruning with many running never drops (or trips over) a running one.
func TestOperationsBoundedAndPruned(t *testing.T) {
	dir := t.TempDir()
	o, err := openOperations(dir)
	if err != nil {
		t.Fatal(err)
	}
	var running []apiv1.Operation
	for i := 0; i < maxRunningOperations-1; i++ {
		op, err := o.start("create_snapshot", fmt.Sprintf("t%d", i))
		if err != nil {
			t.Fatal(err)
		}
		running = append(running, op)
	}
	if _, err := o.start("create_snapshot", "t0"); !errdefs.IsAlreadyExists(err) {
		t.Fatalf("second build of one tag = %v", err)
	}
	// Many finished operations while others run.
	for i := 0; i < keepOperations+50; i++ {
		op, err := o.start("create_snapshot", fmt.Sprintf("done%d", i))
		if err != nil {
			t.Fatal(err)
		}
		o.finish(op.ID, nil)
	}
	last, err := o.start("create_snapshot", "last")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := o.start("create_snapshot", "one-too-many"); !errdefs.IsResourceExhausted(err) {
		t.Fatalf("start beyond %d running = %v, want resource exhausted", maxRunningOperations, err)
	}
	o.finish(last.ID, nil)
	ops := o.list()
	if len(ops) != keepOperations {
		t.Fatalf("%d operations kept, want %d", len(ops), keepOperations)
	}
	for _, op := range running {
		if got, err := o.get(op.ID); err != nil || got.Status != apiv1.OperationRunning {
			t.Fatalf("running operation %s: %+v %v", op.ID, got, err)
		}
	}
	if ents, _ := os.ReadDir(dir); len(ents) != keepOperations {
		t.Fatalf("%d operation files, want %d", len(ents), keepOperations)
	}
}
