package simserver

// Kill stops engine i abruptly, as a crashed process would: its listener and
// every open connection close at once (requests in flight see their
// connection reset, new ones are refused), then its engine stops. The rest
// of the fleet keeps serving; Close still stops everything. Idempotent.
func (f *Fleet) Kill(i int) {
	_ = f.https[i].Close()
	f.Servers[i].Close()
}
