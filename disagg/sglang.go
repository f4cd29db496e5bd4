package disagg

import (
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"strconv"
)

// MaxBatch bounds the batch SGLangBody writes arrays for (the rooms of a
// completions prompt of many strings).
const MaxBatch = 1 << 16

// NewRoom returns a random bootstrap room in [0, 2^63−1] (SMG's range).
func NewRoom() uint64 { return rand.Uint64() >> 1 }

// BatchSize is the number of sequences a request body asks for, as SMG
// counts them to give each its own bootstrap room: a chat's n when above
// 1, a completion's prompt array of strings or of token arrays its length;
// 0 for a single sequence (scalar bootstrap fields).
func BatchSize(body []byte, chat bool) (int, error) {
	if err := checkObject(body); err != nil {
		return 0, err
	}
	if chat {
		raw, ok := lookup(body, "n")
		if !ok || isNull(raw) {
			return 0, nil
		}
		n, err := strconv.Atoi(string(raw))
		if err != nil || n < 1 || n > MaxBatch {
			return 0, fmt.Errorf("n %s: want an integer in [1, %d]", raw, MaxBatch)
		}
		if n == 1 {
			return 0, nil
		}
		return n, nil
	}
	raw, ok := lookup(body, "prompt")
	if !ok || len(raw) == 0 || raw[0] != '[' {
		return 0, nil
	}
	var items []json.RawMessage
	if err := json.Unmarshal(raw, &items); err != nil {
		return 0, err
	}
	if len(items) == 0 {
		return 0, nil
	}
	if c := items[0]; len(c) > 0 && c[0] != '"' && c[0] != '[' {
		return 0, nil // one prompt of token ids
	}
	if len(items) > MaxBatch {
		return 0, fmt.Errorf("prompt of %d items: at most %d", len(items), MaxBatch)
	}
	return len(items), nil
}

// SGLangBody appends to dst the body sent to both P and D under SGLang's
// bootstrap protocol: the client's body with bootstrap_host (P's host,
// IPv6 unbracketed), bootstrap_port (P's; 0 writes null) and bootstrap_room
// set; with rooms of more than one (a batch, BatchSize) each is an array of
// one entry per sequence.
func SGLangBody(dst, body []byte, host string, port int, rooms []uint64) ([]byte, error) {
	if len(rooms) == 0 {
		return nil, fmt.Errorf("sglang body: no bootstrap room")
	}
	hb, _ := json.Marshal(host)
	pb := []byte("null")
	if port > 0 {
		pb = strconv.AppendInt(nil, int64(port), 10)
	}
	var h, p, r []byte
	if len(rooms) == 1 {
		h, p, r = hb, pb, strconv.AppendUint(nil, rooms[0], 10)
	} else {
		h, p, r = []byte{'['}, []byte{'['}, []byte{'['}
		for i, room := range rooms {
			if i > 0 {
				h, p, r = append(h, ','), append(p, ','), append(r, ',')
			}
			h, p, r = append(h, hb...), append(p, pb...), strconv.AppendUint(r, room, 10)
		}
		h, p, r = append(h, ']'), append(p, ']'), append(r, ']')
	}
	return edit(dst, body, []field{{"bootstrap_host", h}, {"bootstrap_port", p}, {"bootstrap_room", r}})
}
