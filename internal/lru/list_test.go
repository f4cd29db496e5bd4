package lru

import (
	"slices"
	"testing"
)

// order returns the list's nodes from head to tail, checking that the
// backward links mirror the forward ones.
func order(t *testing.T, l *List[int], nodes []Node[int]) []int32 {
	t.Helper()
	var fwd []int32
	for i := l.Head(); i >= 0; i = nodes[i].next {
		fwd = append(fwd, i)
	}
	var back []int32
	for i := l.Tail(); i >= 0; i = nodes[i].Prev() {
		back = append(back, i)
	}
	slices.Reverse(back)
	if !slices.Equal(fwd, back) {
		t.Fatalf("forward %v, backward %v", fwd, back)
	}
	return fwd
}

func TestList(t *testing.T) {
	nodes := make([]Node[int], 4)
	var l List[int]
	l.Init()
	if got := order(t, &l, nodes); len(got) != 0 {
		t.Fatalf("empty list holds %v", got)
	}
	for i := range int32(3) {
		l.PushFront(nodes, i)
	}
	steps := []struct {
		op   func()
		want []int32
	}{
		{func() {}, []int32{2, 1, 0}},
		{func() { l.MoveFront(nodes, 0) }, []int32{0, 2, 1}},
		{func() { l.MoveFront(nodes, 0) }, []int32{0, 2, 1}},
		{func() { l.PushBack(nodes, 3) }, []int32{0, 2, 1, 3}},
		{func() { l.Unlink(nodes, 2) }, []int32{0, 1, 3}},
		{func() { l.Unlink(nodes, 0) }, []int32{1, 3}},
		{func() { l.Unlink(nodes, 3) }, []int32{1}},
		{func() { l.Unlink(nodes, 1) }, nil},
		{func() { l.PushBack(nodes, 2) }, []int32{2}},
	}
	for k, s := range steps {
		s.op()
		if got := order(t, &l, nodes); !slices.Equal(got, s.want) {
			t.Fatalf("step %d: %v, want %v", k, got, s.want)
		}
	}
}
