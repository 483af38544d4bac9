package cleanup

import (
	"errors"
	"reflect"
	"testing"
)

func TestRunReverseOrderJoinsErrors(t *testing.T) {
	var s Stack
	var order []int
	first, second := errors.New("first"), errors.New("second")
	s.Add(func() error { order = append(order, 1); return first })
	s.Add(func() error { order = append(order, 2); return nil })
	s.Add(func() error { order = append(order, 3); return second })
	err := s.Run()
	if want := []int{3, 2, 1}; !reflect.DeepEqual(order, want) {
		t.Fatalf("order = %v, want %v", order, want)
	}
	if !errors.Is(err, first) || !errors.Is(err, second) {
		t.Fatalf("Run() = %v, want both errors joined", err)
	}
	if err := s.Run(); err != nil || len(order) != 3 {
		t.Fatalf("second Run() = %v, ran %d undos; want nil and nothing run again", err, len(order))
	}
}

func TestRunEmpty(t *testing.T) {
	var s Stack
	if err := s.Run(); err != nil {
		t.Fatalf("Run() on an empty stack = %v", err)
	}
}

func TestRelease(t *testing.T) {
	var s Stack
	var order []int
	s.Add(func() error { order = append(order, 1); return nil })
	s.Add(func() error { order = append(order, 2); return nil })
	undo := s.Release()
	if err := s.Run(); err != nil || len(order) != 0 {
		t.Fatalf("Run() after Release = %v, ran %v; want nothing run", err, order)
	}
	if err := undo(); err != nil {
		t.Fatal(err)
	}
	if want := []int{2, 1}; !reflect.DeepEqual(order, want) {
		t.Fatalf("released undo ran %v, want %v", order, want)
	}
}
