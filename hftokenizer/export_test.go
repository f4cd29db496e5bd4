package hftokenizer

// Test hooks for the external benchmarks (compiled into tests only).

// ResetWordCache empties t's word cache (a cold tokenizer).
func ResetWordCache(t *Tokenizer) {
	for i := range t.model.cache.shards {
		sh := &t.model.cache.shards[i]
		sh.mu.Lock()
		sh.m, sh.slots, sh.hand = nil, nil, 0
		sh.mu.Unlock()
	}
}

// UseRegexp2 makes t run regexp2 for every pre-tokenizer pattern, even
// those the scanner covers.
func UseRegexp2(t *Tokenizer) {
	for _, st := range t.steps {
		if st.split != nil {
			st.split.fast = false
		}
	}
}
