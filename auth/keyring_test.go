package auth

import (
	"net/http"
	"slices"
	"testing"
	"time"
)

func TestPresentedKey(t *testing.T) {
	for _, tc := range []struct {
		hdr  http.Header
		want string
	}{
		{http.Header{}, ""},
		{http.Header{"Authorization": {"Bearer " + keyAlice}}, keyAlice},
		{http.Header{"Authorization": {"  bearer  " + keyAlice + " "}}, keyAlice},
		{http.Header{"Authorization": {"Basic " + keyAlice}}, ""},
		{http.Header{"Authorization": {keyAlice}}, ""},
		{http.Header{"Authorization": {"Bearer x"}, "X-Api-Key": {keyBob}}, "x"}, // Authorization wins
		{http.Header{"Authorization": {"Basic x"}, "X-Api-Key": {keyBob}}, ""},   // …even when not Bearer
		{http.Header{"X-Api-Key": {" " + keyBob + " "}}, keyBob},
	} {
		if got := PresentedKey(tc.hdr); got != tc.want {
			t.Errorf("PresentedKey(%v) = %q, want %q", tc.hdr, got, tc.want)
		}
	}
}

func TestKeyringLookup(t *testing.T) {
	var c Config
	if err := c.AddKeys("alice plain:"+keyAlice+" models=m rpm=5 max_priority=2; alice plain:"+keyAlice+"-new models=m rpm=5 max_priority=2; bob plain:"+keyBob, "test"); err != nil {
		t.Fatal(err)
	}
	kr, changes, err := Load(c, nil)
	if err != nil || len(changes) != 0 {
		t.Fatalf("Load: %v, changes %v", err, changes)
	}
	if ps := kr.Principals(); len(ps) != 2 || ps[0].Name != "alice" || ps[1].Name != "bob" {
		t.Fatalf("principals %+v, want alice, bob", ps)
	}
	a, a2, b := kr.Lookup(keyAlice), kr.Lookup(keyAlice+"-new"), kr.Lookup(keyBob)
	if a == nil || a != a2 || b == nil || a == b {
		t.Fatalf("lookup: alice %p, alice's second key %p, bob %p: want one principal per name", a, a2, b)
	}
	if kr.Lookup("sk-nope") != nil || kr.Lookup(HashKey(keyAlice)) != nil || kr.Lookup("") != nil {
		t.Fatal("an unknown key, a stored hash or no key found a principal")
	}
	if !a.Allows("m") || a.Allows("other") || !b.Allows("other") {
		t.Error("model grant: alice m only, bob every model")
	}
	if !a.CapPriority || a.MaxPriority != 2 || b.CapPriority || a.Limits == nil || b.Limits != nil {
		t.Errorf("alice cap %v %d limits %v; bob cap %v limits %v", a.CapPriority, a.MaxPriority, a.Limits, b.CapPriority, b.Limits)
	}
	if empty, _, err := Load(Config{}, nil); err != nil || empty.Lookup(keyAlice) != nil || len(empty.Principals()) != 0 {
		t.Fatalf("no keys: %v", err)
	}
}

// TestLoadKeepsLimits: a reload keeps a key's buckets by name, whatever its
// hashes, and changes its limits only when the change is applied.
func TestLoadKeepsLimits(t *testing.T) {
	t0 := time.Now()
	kr, _, err := Load(Config{Keys: []Key{{Name: "a", Hash: HashKey("ka"), RequestsPerMinute: 10}, {Name: "b", Hash: HashKey("kb")}}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	lim := kr.Lookup("ka").Limits
	if c := lim.Charge(t0, 0, 0, http.Header{}); !c.OK {
		t.Fatalf("first request refused: %+v", c)
	}
	next, changes, err := Load(Config{Keys: []Key{{Name: "a", Hash: HashKey("ka2"), RequestsPerMinute: 20}, {Name: "c", Hash: HashKey("kc")}}}, kr)
	if err != nil {
		t.Fatal(err)
	}
	if next.Lookup("ka") != nil || next.Lookup("ka2").Limits != lim {
		t.Fatal("rotated key a: the old hash still passes, or new buckets")
	}
	if req, _ := lim.Levels(); req != 9 {
		t.Fatalf("before the change is applied: %v requests left, want 9", req)
	}
	if len(changes) != 1 {
		t.Fatalf("changes %+v, want a's", changes)
	}
	changes[0].Apply(t0)
	if req, _ := lim.Levels(); req != 19 {
		t.Fatalf("raised to 20: %v requests left, want 19 (what was used stays used)", req)
	}
	added, removed, changed := Changes(kr, next)
	if !slices.Equal(added, []string{"c"}) || !slices.Equal(removed, []string{"b"}) || !slices.Equal(changed, []string{"a"}) {
		t.Errorf("Changes: added %v removed %v changed %v", added, removed, changed)
	}
	if added, removed, changed := Changes(nil, kr); !slices.Equal(added, []string{"a", "b"}) || removed != nil || changed != nil {
		t.Errorf("Changes from no keyring: added %v removed %v changed %v", added, removed, changed)
	}
	if _, _, changed := Changes(kr, kr); changed != nil {
		t.Errorf("a keyring against itself changed %v", changed)
	}
}
