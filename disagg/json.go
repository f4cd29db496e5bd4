package disagg

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"slices"

	"github.com/infergate/infergate/internal/jsonvalue"
	"github.com/infergate/infergate/openai"
)

// Bounds of what the package parses and edits (every parser here is
// bounded, gateway/README.md "Limits"): a body at most MaxBodyBytes, nested
// at most openai.MaxDepth levels (what the gateway accepts from clients),
// and an engine's answer read for its parameters at most MaxResponseBytes.
const (
	MaxBodyBytes     = 64 << 20
	MaxResponseBytes = 1 << 20
)

// errNotObject is returned for a body that is not one JSON object.
var errNotObject = errors.New("not a JSON object")

// member is one top-level member of a JSON object: its key (escapes
// decoded) and the byte spans of its raw key and of its value.
type member struct {
	key    string
	k0, v0 int // start of the raw key (its quote), of the value
	v1     int // end of the value
}

// checkObject reports why body cannot be edited: too large, not valid
// JSON, nested deeper than openai.MaxDepth, or not an object.
func checkObject(body []byte) error {
	switch {
	case len(body) > MaxBodyBytes:
		return fmt.Errorf("body of %d bytes over the limit of %d", len(body), MaxBodyBytes)
	case openai.TooDeep(body):
		return fmt.Errorf("body nested deeper than %d levels", openai.MaxDepth)
	case !json.Valid(body):
		return errors.New("body is not valid JSON")
	}
	b := bytes.TrimLeft(body, " \t\r\n")
	if len(b) == 0 || b[0] != '{' {
		return errNotObject
	}
	return nil
}

// members lists the top-level members of body, which checkObject
// accepted, in order. The walk is iterative: strings are skipped quote to
// quote, nested values by counting brackets outside strings.
func members(body []byte, dst []member) ([]member, error) {
	i := jsonvalue.SkipSpace(body, 0)
	if i >= len(body) || body[i] != '{' {
		return nil, errNotObject
	}
	i = jsonvalue.SkipSpace(body, i+1)
	if i < len(body) && body[i] == '}' {
		return dst, nil
	}
	for i < len(body) {
		if body[i] != '"' {
			return nil, errNotObject
		}
		k0 := i
		end := jsonvalue.StringEnd(body, i) + 1
		if end <= 0 {
			return nil, errNotObject
		}
		esc := bytes.IndexByte(body[k0+1:end-1], '\\') >= 0
		key := string(body[k0+1 : end-1])
		if esc {
			if err := json.Unmarshal(body[k0:end], &key); err != nil {
				return nil, err
			}
		}
		i = jsonvalue.SkipSpace(body, end)
		if i >= len(body) || body[i] != ':' {
			return nil, errNotObject
		}
		v0 := jsonvalue.SkipSpace(body, i+1)
		v1 := jsonvalue.Skip(body, v0)
		if v1 < 0 {
			return nil, errNotObject
		}
		dst = append(dst, member{key: key, k0: k0, v0: v0, v1: v1})
		i = jsonvalue.SkipSpace(body, v1)
		if i >= len(body) {
			return nil, errNotObject
		}
		if body[i] == '}' {
			return dst, nil
		}
		if body[i] != ',' {
			return nil, errNotObject
		}
		i = jsonvalue.SkipSpace(body, i+1)
	}
	return nil, errNotObject
}

// field is a top-level member to set: its key and raw JSON value.
type field struct {
	key   string
	value []byte
}

// edit appends to dst the JSON object body with the members of set given
// their values (in place, where body has the key: its first occurrence;
// appended in set's order otherwise), the members named in del removed,
// and every other member kept byte for byte in its order. Repeated keys
// that are set or deleted keep none of their later occurrences (Python's
// json reads the last one: the engine must see the value set). The spaces
// between members are not kept.
func edit(dst, body []byte, set []field, del ...string) ([]byte, error) {
	if err := checkObject(body); err != nil {
		return nil, err
	}
	var scratch [32]member
	ms, err := members(body, scratch[:0])
	if err != nil {
		return nil, err
	}
	done := make([]bool, len(set))
	dst = append(dst, '{')
	n := 0
	sep := func() {
		if n > 0 {
			dst = append(dst, ',')
		}
		n++
	}
next:
	for _, m := range ms {
		for _, d := range del {
			if m.key == d {
				continue next
			}
		}
		for j, f := range set {
			if m.key != f.key {
				continue
			}
			if !done[j] {
				done[j] = true
				sep()
				dst = append(append(dst, body[m.k0:m.v0]...), f.value...)
			}
			continue next
		}
		sep()
		dst = append(dst, body[m.k0:m.v1]...)
	}
	for j, f := range set {
		if done[j] {
			continue
		}
		sep()
		kb, _ := json.Marshal(f.key)
		dst = append(append(append(dst, kb...), ':'), f.value...)
	}
	return append(dst, '}'), nil
}

// lookup returns the raw value of body's last top-level member named key
// (the one Python's json keeps) and whether there is one; body must be an
// object checkObject accepted.
func lookup(body []byte, key string) ([]byte, bool) {
	var scratch [32]member
	ms, err := members(body, scratch[:0])
	if err != nil {
		return nil, false
	}
	for i := len(ms) - 1; i >= 0; i-- {
		if ms[i].key == key {
			return body[ms[i].v0:ms[i].v1], true
		}
	}
	return nil, false
}

// isNull reports whether a raw value is JSON null.
func isNull(v []byte) bool { return bytes.Equal(bytes.TrimSpace(v), []byte("null")) }

// ClientParams are the top-level request members that steer a P/D hand-off:
// vLLM's kv_transfer_params (NIXL and Mooncake: which engine's KV to read
// or to hold) and SGLang's bootstrap_host, bootstrap_port and
// bootstrap_room. They are the gateway's to set: from a client they would
// make an engine connect to a host the client names (with the gateway's
// credentials) or hold its KV until its abort timeout.
var ClientParams = []string{"kv_transfer_params", "bootstrap_host", "bootstrap_port", "bootstrap_room"}

// StripClientParams appends to dst body without its ClientParams members
// (every occurrence, keys compared unescaped as an engine's JSON reader
// reads them) and reports whether it had any; with none it returns body
// itself and false, allocating nothing. body must be a JSON object.
func StripClientParams(dst, body []byte) ([]byte, bool, error) {
	if maybeClientParams(body) {
		return stripClientParams(dst, body)
	}
	return body, false, nil
}

// maybeClientParams reports whether body may name a ClientParams member: a
// key spells them literally, or with \u escapes (their characters need no
// other escape). Anything but an object's opening brace goes to the full
// check, which refuses it. It saves every chat and completion without them
// the member walk: 58–79 µs and 8 allocations for a 12 KB body
// (BenchmarkStripClientParams) down to 5.4 µs and none.
func maybeClientParams(body []byte) bool {
	t := bytes.TrimLeft(body, " \t\r\n")
	return len(t) == 0 || t[0] != '{' || bytes.Contains(body, []byte("kv_transfer_params")) ||
		bytes.Contains(body, []byte("bootstrap_")) || bytes.Contains(body, []byte(`\u`))
}

func stripClientParams(dst, body []byte) ([]byte, bool, error) {
	if err := checkObject(body); err != nil {
		return nil, false, err
	}
	var scratch [32]member
	ms, err := members(body, scratch[:0])
	if err != nil {
		return nil, false, err
	}
	found := false
	for _, m := range ms {
		if slices.Contains(ClientParams, m.key) {
			found = true
			break
		}
	}
	if !found {
		return body, false, nil
	}
	out, err := edit(dst, body, nil, ClientParams...)
	return out, true, err
}
