// Package replica is what gateway replicas behind one L4 balancer exchange
// so that they keep cache affinity together: what each replica's
// approximate prefix index learnt from its routing decisions (Learn), and
// its per-endpoint in-flight load (Load). It is pure: messages are bytes
// in and out, time is passed in; the live gateway carries them over Redis
// Streams (package replica/stream) and the virtual-time fleet (package
// virtual) delivers them after a modelled delay, both through Node.Apply.
//
// Precise state needs no exchange: every replica subscribes to every
// engine's KV events itself.
package replica

import (
	"encoding/binary"
	"errors"
	"fmt"
	"slices"

	"github.com/infergate/infergate/sched"
)

// Wire format, version 1 (all integers unsigned LEB128 varints as
// encoding/binary's Uvarint, times zigzag varints; strings are a length
// then bytes):
//
//	message  = version(1 byte: 1) kind(1 byte) id(string) at(varint ns) body
//	learn    = model(string) endpoint(string) prompt pending (uvarints) n(uvarint) n × hash(8 bytes, little endian)
//	learn_pd = role(1 byte: 1 prefill, 2 decode) learn
//	load     = n(uvarint) n × (endpoint(string) in_flight tokens prefill (uvarints))
//	finish   = model(string) endpoint(string) n(uvarint) n × hash(8 bytes, little endian)
//	finish_ref = model(string) endpoint(string) n(uvarint, 1..MaxHashes) last(8 bytes, little endian)
//
// id is the sending replica's id, at its clock when it sent (ns; the wall
// clock's Unix time live, simulated time in virtual time), endpoint the
// endpoint's URL as the configuration names it (a slot index means
// nothing to another replica whose configuration may order endpoints
// differently), prompt the request's prompt tokens and pending those it
// was not expected to find cached (its part of the endpoint's prefill
// backlog, load.Ledger.Send), hashes the prompt's chained block hashes (prefix.Hashes
// under the pool's seed: every replica of one configuration computes the
// same). A finish (kind 4, since 2026-12-05) says that a request the
// sender routed to endpoint ended there (answered, failed or cut short):
// the engine released the prompt's blocks, which peers that evict in the
// engine's order touch (sched.PeerFinisher; routing.prefix.learn_on_finish).
// It carries the prompt's hashes again rather than naming the learn, so
// that it needs no state on the receiver and stays correct when a learn or
// a finish is dropped or a replica restarts between the two. A replica
// older than kind 4 counts a finish as malformed and skips it (its index
// then orders peers' prompts by routing time, as before). A finish_ref
// (kind 5, since 2026-12-05; AppendFinishRef) is a finish that names the
// learn it ends instead of repeating its hashes: the prompt's block count
// and last chained hash (which names the whole chain, prefix.Hashes), about
// 40 bytes instead of 8 per block (6.9 KB for the Mooncake mean prompt). A
// receiver releases the pin that learn took (the pin table's key is that
// name: peer, endpoint, last hash, count) and touches the prompt with the
// hashes the pin kept; a receiver that holds no such pin (the learn lost,
// read before it started, or its pin expired, or a profile that never
// pins) has nothing to touch with and only counts it
// (Counts.FinishesUnmatched): the cost of halving the stream's bytes is the
// touch of a request whose learn was lost, which the index then orders by
// its learn's time, or not at all. A replica older than kind 5 counts a
// finish_ref as malformed and skips it. Every size is bounded (the Max constants) and a message must end
// exactly where its body does: a hostile or corrupt stream entry is an
// error, never a panic nor an allocation beyond len(message).
const (
	// Version is the wire format's version byte.
	Version = 1
	// MaxMessage is the largest message accepted (bytes): a learn of
	// MaxHashes hashes with the longest names fits.
	MaxMessage = 1 << 20
	// MaxID, MaxModel and MaxEndpoint bound the strings (bytes).
	MaxID       = 128
	MaxModel    = 256
	MaxEndpoint = 512
	// MaxHashes bounds a learn's block hashes: 65,536 blocks, a 1M-token
	// prompt at the default 16-token block (a longer prompt's head is
	// sent: the index matches leading blocks).
	MaxHashes = 1 << 16
	// MaxLoadEntries bounds a load message's endpoints.
	MaxLoadEntries = 4096
	// maxCount bounds a load count (requests, tokens): 2^40.
	maxCount = 1 << 40
)

// Kind is a message's kind.
type Kind uint8

// Message kinds.
const (
	// KindLearn: a replica routed a prompt to an endpoint.
	KindLearn Kind = 1
	// KindLoad: a replica's in-flight load per endpoint.
	KindLoad Kind = 2
	// KindLearnPD: a learn of one profile of a P/D pool (Msg.Role) on the
	// wire; Decode returns it as KindLearn with Role set.
	KindLearnPD Kind = 3
	// KindFinish: a request a replica routed to an endpoint ended there
	// (Msg.Model, Endpoint, Hashes; AppendFinish).
	KindFinish Kind = 4
	// KindFinishRef: a finish that names its learn (Msg.Model, Endpoint,
	// Blocks, Last; AppendFinishRef) instead of carrying its hashes;
	// Decode returns it as KindFinish with Hashes empty and Blocks > 0.
	KindFinishRef Kind = 5
)

func (k Kind) String() string {
	switch k {
	case KindLearn:
		return "learn"
	case KindLoad:
		return "load"
	case KindLearnPD:
		return "learn_pd"
	case KindFinish:
		return "finish"
	case KindFinishRef:
		return "finish_ref"
	}
	return fmt.Sprintf("kind(%d)", uint8(k))
}

// Load is one endpoint's in-flight load as one replica accounts it
// (load.Ledger: requests, their prompt tokens, the prefill backlog in
// tokens).
type Load struct {
	InFlight, InFlightTokens, PendingPrefill int64
}

// LoadEntry is an endpoint's Load in a load message.
type LoadEntry struct {
	Endpoint string
	Load
}

// Msg is a decoded message. Decode reuses its slices.
type Msg struct {
	Kind Kind
	// ID is the sender's replica id; At its clock when sent (ns).
	ID string
	At int64
	// Learn: the pool's model, the endpoint's URL, the prompt's tokens,
	// those of them the endpoint was expected to prefill, and its block
	// hashes. Finish: the model, the endpoint's URL and the hashes.
	Model, Endpoint string
	Prompt, Pending int64
	Hashes          []uint64
	// Blocks and Last name a finish_ref's learn (KindFinish with Blocks >
	// 0 and Hashes empty): the prompt's block count and its last chained
	// block hash. Zero for every other message.
	Blocks int
	Last   uint64
	// Role is the P/D profile whose pick a learn was (sched.RolePrefill or
	// RoleDecode; RoleBoth: the pool's one policy).
	Role sched.Role
	// Load: the sender's load per endpoint.
	Loads []LoadEntry
	// recent is the ids and models decoded into this Msg lately (their
	// strings reused).
	recent recentStrings
}

// recentStrings keeps the last few strings a Msg decoded for replica ids
// and models, so that a reader decoding every message into one Msg
// allocates a peer's id or a model's name once, not once per message (a
// fleet has a few replicas and models). Bounded: 8 strings of at most
// MaxModel bytes.
type recentStrings struct {
	s    [8]string
	next uint8
}

// get returns a string equal to b: a kept one, or a new one kept in place
// of the oldest.
func (c *recentStrings) get(b []byte) string {
	for _, s := range &c.s {
		if s == string(b) { // compared without a conversion's allocation
			return s
		}
	}
	s := string(b)
	c.s[c.next%uint8(len(c.s))] = s
	c.next++
	return s
}

// AppendLearn appends a learn message to dst: replica id routed a prompt
// of prompt tokens, pending of them expected uncached, with these block
// hashes to endpoint of model's pool at time at (ns). Strings longer than
// their bound are cut to it, counts clamped to [0, 2^40] and hashes beyond
// MaxHashes dropped (the tail: the index matches leading blocks).
func AppendLearn(dst []byte, id string, at int64, model, endpoint string, prompt, pending int64, hashes []uint64) []byte {
	return AppendLearnRole(dst, id, at, model, endpoint, sched.RoleBoth, prompt, pending, hashes)
}

// AppendLearnRole is AppendLearn for the pick of one profile of a P/D
// pool, role (sched.RolePrefill: the prefill endpoint, where the prompt's
// blocks are computed; sched.RoleDecode: the decode endpoint); RoleBoth,
// or a role out of range, is AppendLearn's message.
func AppendLearnRole(dst []byte, id string, at int64, model, endpoint string, role sched.Role, prompt, pending int64, hashes []uint64) []byte {
	hashes = hashes[:min(len(hashes), MaxHashes)]
	dst = slices.Grow(dst, 3+len(id)+len(model)+len(endpoint)+8*len(hashes)+7*binary.MaxVarintLen64) // one allocation
	if role == sched.RolePrefill || role == sched.RoleDecode {
		dst = appendHeader(dst, KindLearnPD, id, at)
		dst = append(dst, byte(role))
	} else {
		dst = appendHeader(dst, KindLearn, id, at)
	}
	dst = appendString(dst, model, MaxModel)
	dst = appendString(dst, endpoint, MaxEndpoint)
	dst = binary.AppendUvarint(dst, clampCount(prompt))
	dst = binary.AppendUvarint(dst, clampCount(pending))
	return appendHashes(dst, hashes)
}

// AppendFinish appends a finish message to dst: a request of model's pool
// that replica id routed to endpoint, with a prompt of these block hashes,
// ended there at time at (ns). Strings longer than their bound are cut to
// it and hashes beyond MaxHashes dropped, as AppendLearn's.
func AppendFinish(dst []byte, id string, at int64, model, endpoint string, hashes []uint64) []byte {
	hashes = hashes[:min(len(hashes), MaxHashes)]
	dst = slices.Grow(dst, 2+len(id)+len(model)+len(endpoint)+8*len(hashes)+5*binary.MaxVarintLen64) // one allocation
	dst = appendHeader(dst, KindFinish, id, at)
	dst = appendString(dst, model, MaxModel)
	dst = appendString(dst, endpoint, MaxEndpoint)
	return appendHashes(dst, hashes)
}

// AppendFinishRef appends a finish_ref message to dst: the finish of the
// request whose learn carried these hashes (the same slice: its length
// and last hash after AppendLearn's MaxHashes cut name that learn), which
// replica id routed to endpoint of model's pool and which ended there at
// time at (ns). About 40 bytes whatever the prompt's length; with no
// hashes it is AppendFinish's message (nothing to name). Peers release the
// pin the learn took with the hashes they kept (Node.Apply); see the wire
// format above for a peer that kept none.
func AppendFinishRef(dst []byte, id string, at int64, model, endpoint string, hashes []uint64) []byte {
	hashes = hashes[:min(len(hashes), MaxHashes)]
	if len(hashes) == 0 {
		return AppendFinish(dst, id, at, model, endpoint, nil)
	}
	return appendFinishRef(dst, id, at, model, endpoint, len(hashes), hashes[len(hashes)-1])
}

// appendFinishRef appends a finish_ref of a prompt of blocks (1 to
// MaxHashes) hashes whose last is last.
func appendFinishRef(dst []byte, id string, at int64, model, endpoint string, blocks int, last uint64) []byte {
	dst = slices.Grow(dst, 2+len(id)+len(model)+len(endpoint)+8+5*binary.MaxVarintLen64) // one allocation
	dst = appendHeader(dst, KindFinishRef, id, at)
	dst = appendString(dst, model, MaxModel)
	dst = appendString(dst, endpoint, MaxEndpoint)
	dst = binary.AppendUvarint(dst, uint64(blocks))
	return binary.LittleEndian.AppendUint64(dst, last)
}

// appendHashes appends n then n hashes, 8 bytes each, little endian.
func appendHashes(dst []byte, hashes []uint64) []byte {
	dst = binary.AppendUvarint(dst, uint64(len(hashes)))
	for _, h := range hashes {
		dst = binary.LittleEndian.AppendUint64(dst, h)
	}
	return dst
}

// AppendLoad appends a load message to dst: replica id's load per
// endpoint at time at (ns); entries beyond MaxLoadEntries are dropped and
// counts clamped to [0, 2^40].
func AppendLoad(dst []byte, id string, at int64, entries []LoadEntry) []byte {
	dst = appendHeader(dst, KindLoad, id, at)
	entries = entries[:min(len(entries), MaxLoadEntries)]
	dst = binary.AppendUvarint(dst, uint64(len(entries)))
	for _, e := range entries {
		dst = appendString(dst, e.Endpoint, MaxEndpoint)
		dst = binary.AppendUvarint(dst, clampCount(e.InFlight))
		dst = binary.AppendUvarint(dst, clampCount(e.InFlightTokens))
		dst = binary.AppendUvarint(dst, clampCount(e.PendingPrefill))
	}
	return dst
}

func clampCount(n int64) uint64 { return uint64(min(max(n, 0), maxCount)) }

func appendHeader(dst []byte, k Kind, id string, at int64) []byte {
	dst = append(dst, Version, byte(k))
	dst = appendString(dst, id, MaxID)
	return binary.AppendVarint(dst, at)
}

func appendString(dst []byte, s string, limit int) []byte {
	s = s[:min(len(s), limit)]
	dst = binary.AppendUvarint(dst, uint64(len(s)))
	return append(dst, s...)
}

// ErrMalformed wraps every decoding error.
var ErrMalformed = errors.New("replica: malformed message")

// Decode parses b into m, reusing m's slices (and its strings of the
// sender's id and the model when the last few messages decoded into m had
// them). It never panics and allocates at most what b's length justifies
// (strings, hashes and entries are bounded by the bytes present); an
// error wraps ErrMalformed.
func Decode(b []byte, m *Msg) error { return decodeInterned(b, m, nil) }

// decodeInterned is Decode with the endpoint URLs interned by names (nil:
// none): a URL names knows is names' own string, no allocation; a load
// entry of a URL it does not know is left out of m.Loads (the receiver
// keeps no load of an endpoint it lacks), a learn's is allocated as
// Decode does (Target.Resolve then finds no slot for it). So a load
// report of known endpoints, decoded into a reused Msg, allocates
// nothing, whatever its size, and one of unknown URLs allocates nothing
// either: a hostile peer cannot make the reader allocate per entry nor
// keep what it names.
func decodeInterned(b []byte, m *Msg, names Interner) error {
	if err := decode(b, m, names); err != nil {
		return fmt.Errorf("%w: %v", ErrMalformed, err)
	}
	return nil
}

func decode(b []byte, m *Msg, names Interner) error {
	if len(b) > MaxMessage {
		return fmt.Errorf("%d bytes, at most %d", len(b), MaxMessage)
	}
	if len(b) < 2 {
		return errors.New("short header")
	}
	if b[0] != Version {
		return fmt.Errorf("version %d, want %d", b[0], Version)
	}
	r := reader{b: b[2:]}
	m.Kind = Kind(b[1])
	m.ID = m.recent.get(r.bytes(MaxID, "id"))
	m.At = r.varint("time")
	m.Model, m.Endpoint, m.Prompt, m.Pending, m.Role = "", "", 0, 0, sched.RoleBoth
	m.Blocks, m.Last = 0, 0
	m.Hashes, m.Loads = m.Hashes[:0], m.Loads[:0]
	if m.Kind == KindLearnPD {
		b := r.take(1, "role")
		switch {
		case b == nil: // short: r.err is set
		case sched.Role(b[0]) == sched.RolePrefill || sched.Role(b[0]) == sched.RoleDecode:
			m.Kind, m.Role = KindLearn, sched.Role(b[0])
		default:
			r.fail("unknown role %d", b[0])
		}
	}
	switch m.Kind {
	case KindLearn, KindFinish:
		m.Model = m.recent.get(r.bytes(MaxModel, "model"))
		m.Endpoint = intern(names, r.bytes(MaxEndpoint, "endpoint"))
		if m.Kind == KindLearn {
			m.Prompt = r.load("prompt")
			m.Pending = r.load("pending")
		}
		n := r.count(MaxHashes, 8, "hashes")
		for range n {
			if r.err != nil {
				break
			}
			m.Hashes = append(m.Hashes, binary.LittleEndian.Uint64(r.take(8, "hash")))
		}
	case KindFinishRef:
		m.Kind = KindFinish
		m.Model = m.recent.get(r.bytes(MaxModel, "model"))
		m.Endpoint = intern(names, r.bytes(MaxEndpoint, "endpoint"))
		n := r.uvarint("blocks")
		if r.err == nil && (n == 0 || n > MaxHashes) {
			r.fail("finish_ref of %d blocks, want 1 to %d", n, MaxHashes)
		}
		if last := r.take(8, "last hash"); r.err == nil {
			m.Blocks, m.Last = int(n), binary.LittleEndian.Uint64(last)
		}
	case KindLoad:
		n := r.count(MaxLoadEntries, 4, "load entries") // an entry takes at least 4 bytes
		for range n {
			if r.err != nil {
				break
			}
			var e LoadEntry
			url := r.bytes(MaxEndpoint, "endpoint")
			known := true
			if names != nil {
				e.Endpoint, known = names.Intern(url)
			} else {
				e.Endpoint = string(url)
			}
			e.InFlight = r.load("in_flight")
			e.InFlightTokens = r.load("tokens")
			e.PendingPrefill = r.load("prefill")
			if known && r.err == nil {
				m.Loads = append(m.Loads, e)
			}
		}
	default:
		return fmt.Errorf("unknown kind %d", uint8(m.Kind))
	}
	if r.err != nil {
		return r.err
	}
	if len(r.b) != 0 {
		return fmt.Errorf("%d trailing bytes after the %s body", len(r.b), m.Kind)
	}
	if m.ID == "" {
		return errors.New("empty replica id")
	}
	return nil
}

// reader reads b front to back; the first error sticks and later reads
// return zero values.
type reader struct {
	b   []byte
	err error
}

func (r *reader) fail(format string, a ...any) {
	if r.err == nil {
		r.err = fmt.Errorf(format, a...)
	}
	r.b = nil
}

func (r *reader) uvarint(what string) uint64 {
	if r.err != nil {
		return 0
	}
	v, n := binary.Uvarint(r.b)
	if n <= 0 {
		r.fail("bad %s varint", what)
		return 0
	}
	r.b = r.b[n:]
	return v
}

func (r *reader) varint(what string) int64 {
	if r.err != nil {
		return 0
	}
	v, n := binary.Varint(r.b)
	if n <= 0 {
		r.fail("bad %s varint", what)
		return 0
	}
	r.b = r.b[n:]
	return v
}

func (r *reader) take(n int, what string) []byte {
	if r.err != nil {
		return nil
	}
	if n > len(r.b) {
		r.fail("%s: %d bytes, %d left", what, n, len(r.b))
		return nil
	}
	v := r.b[:n]
	r.b = r.b[n:]
	return v
}

// bytes reads a string of at most limit bytes; the slice is b's.
func (r *reader) bytes(limit int, what string) []byte {
	n := r.uvarint(what)
	if n > uint64(limit) {
		r.fail("%s of %d bytes, at most %d", what, n, limit)
		return nil
	}
	return r.take(int(n), what)
}

// Interner interns endpoint URLs (Node.Apply's decoding; Target).
type Interner interface {
	// Intern returns the receiver's own string equal to url, without
	// allocating, when url is one of its endpoints; ok false otherwise.
	Intern(url []byte) (s string, ok bool)
}

// intern is url as names' string, or a new one when names does not know
// it (or is nil).
func intern(names Interner, url []byte) string {
	if names != nil {
		if s, ok := names.Intern(url); ok {
			return s
		}
	}
	return string(url)
}

// count reads a count of at most limit items of at least size bytes each
// that must fit in what is left.
func (r *reader) count(limit, size int, what string) int {
	n := r.uvarint(what)
	if n > uint64(limit) || n*uint64(size) > uint64(len(r.b)) {
		r.fail("%d %s (at most %d, %d bytes left)", n, what, limit, len(r.b))
		return 0
	}
	return int(n)
}

func (r *reader) load(what string) int64 {
	v := r.uvarint(what)
	if v > maxCount {
		r.fail("%s %d over %d", what, v, uint64(maxCount))
		return 0
	}
	return int64(v)
}
