package ssetest

import (
	"reflect"
	"testing"
)

func TestEvents(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want []Event
	}{
		{"data: a\n\n", []Event{{Data: "a"}}},
		{"\uFEFFdata: a\r\rdata: b\r\n\r\n", []Event{{Data: "a"}, {Data: "b"}}},
		{"event: x\nevent: y\ndata:a\ndata: b\n\n", []Event{{Data: "a\nb", Type: "y"}}},
		{"data\n\n", []Event{{Data: ""}}},
		{"event: x\n\ndata: a\n\n", []Event{{Data: "a"}}}, // the type is reset by the empty event
		{": c\nid: 1\nretry: 5\n\n", nil},
		{"data: a\n\ndata: b", []Event{{Data: "a"}}},   // unfinished at the end
		{"data: a\n\ndata: b\n", []Event{{Data: "a"}}}, // still unfinished
		{"data:  two spaces\r\n\r\n", []Event{{Data: " two spaces"}}},
	} {
		if got := Events([]byte(tc.in)); !reflect.DeepEqual(got, tc.want) {
			t.Errorf("%q: %+v, want %+v", tc.in, got, tc.want)
		}
	}
}
