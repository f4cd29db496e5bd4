package gateway

import (
	"bytes"
	"encoding/json"
	"strconv"
	"strings"
	"testing"
)

func TestAppendJSONString(t *testing.T) {
	for _, s := range []string{"", "plain", `q"b\`, "nl\n\r\t\x00\x1f\x7f", "é中😀", "\xff\xfe", "a\u2028b\u2029", "<&>"} {
		checkJSONString(t, s)
	}
}

// checkJSONString requires appendJSONString(s) to decode as encoding/json's
// encoding of s does, and to be one line.
func checkJSONString(t *testing.T, s string) {
	t.Helper()
	got := appendJSONString(nil, s)
	want, _ := json.Marshal(s)
	var a, b string
	if err := json.Unmarshal(got, &a); err != nil {
		t.Fatalf("appendJSONString(%q) = %s: %v", s, got, err)
	}
	_ = json.Unmarshal(want, &b)
	if a != b || bytes.ContainsAny(got, "\n\r") {
		t.Fatalf("appendJSONString(%q) = %s, decodes to %q; encoding/json: %s (%q)", s, got, a, want, b)
	}
}

func FuzzAppendJSONString(f *testing.F) {
	for _, s := range []string{"", "plain", `q"b\`, "nl\n\r\t\x00\x1f", "é中😀", "\xff\xfe\xed\xa0\x80", "a\u2028b", "\"}\n{\"level\":\"ERROR\""} {
		f.Add(s)
	}
	f.Fuzz(checkJSONString)
}

func FuzzAppendTextValue(f *testing.F) {
	for _, s := range []string{"", "plain", "a b", "k=v", `q"`, "nl\nlevel=ERROR", "\x00\xff", "é"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		got := string(appendTextValue(nil, s))
		if strings.ContainsAny(got, "\n\r") || (got != s && got != strconv.Quote(s)) {
			t.Fatalf("appendTextValue(%q) = %q", s, got)
		}
		if got == s && (s == "" || strings.ContainsAny(s, " =\"")) {
			t.Fatalf("appendTextValue(%q) unquoted", s)
		}
		if got != s {
			if u, err := strconv.Unquote(got); err != nil || u != s {
				t.Fatalf("appendTextValue(%q) = %q does not unquote back (%q, %v)", s, got, u, err)
			}
		}
	})
}
